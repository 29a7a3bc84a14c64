"""A fast read-only GGUF container reader: metadata, tensor table, memory-mapped tensor bytes.

Why not `gguf.GGUFReader`: it builds a numpy view per string of the tokenizer arrays (SmolLM2's
49k tokens + 49k merges), seconds on every open. We need only scalar metadata and the
tensor table, so this parses the header with `struct`, skips string arrays, and leaves the
formats (type ids, block sizes) and dequantization to the `gguf` package.
Layout (GGUF v2/v3, little-endian): magic, version u32, tensor_count u64, kv_count u64,
kv pairs, tensor infos, padding to `general.alignment`, then tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

from tokenbus.utils import round_up

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SUPPORTED_VERSIONS = (2, 3)
_MAX_ARRAY_LENGTH = 1024  # longer arrays are tokenizer data: skipped, only their length kept


class _FormatError(Exception):
    """The bytes do not form a GGUF header (reported as a ValueError naming the file)."""


@dataclass(frozen=True)
class SkippedArray:
    """An array left unread (tokenizer vocabulary, merges, token types): its length, and where
    its items begin in the file for the rare reader that needs a few of them (`string_ids`)."""

    length: int
    offset: int = field(default=0, compare=False)


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[
        int, ...
    ]  # numpy order, outermost first: [out, in] for a matrix (GGUF stores it reversed)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[
        str, Any
    ]  # scalars, strings, numeric arrays as lists, string arrays as SkippedArray
    tensors: dict[str, GGUFTensorInfo]

    def tensor_bytes(self, info: GGUFTensorInfo, writable: bool = False) -> np.ndarray:
        """The tensor's raw bytes, memory-mapped, shaped as gguf.quants expects:
        [..., row bytes]. `writable`: copy-on-write (a torch tensor over it then needs no copy;
        the file never changes)."""
        raw = np.memmap(
            self.path,
            dtype=np.uint8,
            mode="c" if writable else "r",
            offset=info.offset,
            shape=(info.nbytes,),
        )
        return raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.pos = buffer, 0

    def read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def read_str(self) -> str:
        length = self.read("<Q")
        if self.pos + length > len(self.buffer):
            raise EOFError("string runs past the end of the file")
        self.pos += length
        return self.buffer[self.pos - length : self.pos].decode("utf-8")

    def read_value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.read_str()
        if vtype == GGUFValueType.ARRAY:
            return self._read_array()
        if vtype not in _SCALAR_FORMATS:
            raise _FormatError(f"unknown metadata value type {vtype}")
        return self.read(_SCALAR_FORMATS[vtype])

    def _read_array(self) -> list | SkippedArray:
        item_type, length = self.read("<I"), self.read("<Q")
        if item_type == GGUFValueType.STRING:  # skip: only the lengths need reading
            offset = self.pos
            for _ in range(length):
                self.pos += 8 + struct.unpack_from("<Q", self.buffer, self.pos)[0]
            return SkippedArray(length, offset)
        if (
            item_type in _SCALAR_FORMATS and length > _MAX_ARRAY_LENGTH
        ):  # e.g. tokenizer token types
            self.pos += length * struct.calcsize(_SCALAR_FORMATS[item_type])
            return SkippedArray(length)
        return [self.read_value(item_type) for _ in range(length)]


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header of a GGUF file; ValueError naming the file if it is not one or is
    damaged."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise _FormatError("empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse(path, buffer)
    except (_FormatError, OSError, EOFError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupted?): {e}") from e


def string_ids(gf: GGUFFile, key: str, wanted: tuple[str, ...]) -> dict[str, int]:
    """The index of each of `wanted` found in the skipped string array `key` (a tokenizer's
    tokens), read from the file now: the header parse leaves string arrays unread."""
    skipped = gf.metadata.get(key)
    if not isinstance(skipped, SkippedArray) or not skipped.offset:
        return {}
    targets = {text.encode("utf-8"): text for text in wanted}
    found: dict[str, int] = {}
    with open(gf.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        pos = skipped.offset
        for index in range(skipped.length):
            (length,) = struct.unpack_from("<Q", buffer, pos)
            text = targets.get(buffer[pos + 8 : pos + 8 + length])
            if text is not None:
                found[text] = index
            pos += 8 + length
    return found


def _parse(path: Path, buffer: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(buffer)
    if cursor.read("<I") != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    version = cursor.read("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path}: unsupported GGUF version {version} "
            f"(supported: {_SUPPORTED_VERSIONS}, little-endian)"
        )
    num_tensors, num_kvs = cursor.read("<Q"), cursor.read("<Q")
    metadata = {}
    for _ in range(num_kvs):
        key = cursor.read_str()
        metadata[key] = cursor.read_value(cursor.read("<I"))
    table = [_read_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    data_start = round_up(cursor.pos, alignment)
    tensors = {}
    for name, shape, type_id, rel_offset in table:
        qtype = _known_qtype(path, name, type_id)
        nbytes = _tensor_nbytes(path, name, shape, qtype)
        info = GGUFTensorInfo(name, shape, qtype, data_start + rel_offset, nbytes)
        if info.offset + info.nbytes > len(buffer):
            raise ValueError(
                f"{path}: truncated or corrupted GGUF: tensor {name} ends at byte "
                f"{info.offset + info.nbytes} but the file has {len(buffer)} bytes"
            )
        tensors[name] = info
    return GGUFFile(path, metadata, tensors)


def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.read_str()
    dims = [cursor.read("<Q") for _ in range(cursor.read("<I"))]  # GGML order: innermost first
    type_id = cursor.read("<I")
    return name, tuple(reversed(dims)), type_id, cursor.read("<Q")


def _known_qtype(path: Path, name: str, type_id: int) -> GGMLQuantizationType:
    """The tensor's type, if the gguf package knows its block layout (the loader then says
    whether tokenbus runs it); a ValueError naming the tensor otherwise."""
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        qtype = None
    if qtype is None or qtype not in GGML_QUANT_SIZES:
        raise ValueError(
            f"{path}: tensor {name} has GGML type id {type_id}, unknown to the installed gguf "
            "package (a type newer than it, or a damaged file): not supported"
        )
    return qtype


def _tensor_nbytes(
    path: Path, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType
) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(
            f"{path}: tensor {name} row length {shape[-1]} is not a multiple of "
            f"{qtype.name}'s block size {block_size}"
        )
    return int(np.prod(shape)) // block_size * type_size
