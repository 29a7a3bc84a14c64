"""One K/V block (every layer) per safetensors file, keyed by its block hash (L2).

    <root>/<layout fingerprint>/<hash[:2]>/<hash hex>.safetensors

A file holds one tensor "kv", a block as the pool holds it ([num_layers, 2, block_size, Hkv,
row] of the pool's dtype, block_bytes.BlockSpec), and metadata: the format, the block hash and
an xxh3-64 digest of the tensor bytes. Writes go to a temporary file in the same directory and
are renamed into place, so a crash leaves either the whole file or none. A file of another
format, block, shape or dtype, a truncated one or one failing its digest is a miss (and
removed): its blocks are recomputed.

Loads read the tensor bytes straight into their destination (`read_into`: the pool's byte
ranges of one block): one pread of the header, checked before anything is written, and one
preadv of the tensor; then the digest of the bytes where they landed. No parse copies, no
staging tensor. Bytes that fail the digest have reached the destination: the caller treats the
block as not loaded (the connectors report it invalid, and the scheduler recomputes it).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import xxhash

from tokenbus.kv_transfer.block_bytes import BlockSpec, tensor_bytes

logger = logging.getLogger(__name__)

# 2: an xxh3-64 digest (a CRC-32 ran at ~5 GB/s, a fifth of a page-cache read) and a header
# written here, the same for every block of a layout. Files of another format are misses.
FORMAT = "tokenbus-kv-block-2"
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 1 << 16  # a longer header is not one of ours: never read it whole
# safetensors' dtype codes of the pool dtypes (fp8 and q8_0 K/V are stored as fp8 and bytes).
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class CorruptBlockFile(Exception):
    """A block file that must not be loaded (truncated, altered, or another block's)."""


class BlockFiles:
    def __init__(self, root: str | os.PathLike, layout_fingerprint: str) -> None:
        self.dir = Path(root) / layout_fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self._dir = str(self.dir)
        # Our header's length for a block of a spec (the digest is fixed-width, block hashes are
        # sha256): a read fetches exactly it first; any other length costs a second read.
        self._header_lens: dict[BlockSpec, int] = {}

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def exists(self, block_hash: bytes) -> bool:
        return self.path(block_hash).is_file()

    # ------------------------------------------------------------------ write
    def write(self, block_hash: bytes, kv: torch.Tensor) -> int:
        """Store one block's K/V (any device); returns the file's size in bytes."""
        kv = kv.detach().to("cpu").contiguous()
        data = tensor_bytes(kv)
        spec = BlockSpec(kv.dtype, tuple(kv.shape))
        header = _header(block_hash, spec, xxhash.xxh3_64_intdigest(data))
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:  # buffered: it loops over short writes
                f.write(header)
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old state or the whole new file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(header) + len(data)

    # ------------------------------------------------------------------ read
    def read_into(self, block_hash: bytes, chunks: Sequence[memoryview], spec: BlockSpec) -> None:
        """Read a block of `spec` into `chunks`, writable byte ranges that in order make up its
        tensor. FileNotFoundError if absent; CorruptBlockFile (the file removed) if bad or not
        of `spec`: the header is checked before `chunks` are written, the digest after."""
        if sum(len(c) for c in chunks) != spec.nbytes:
            raise ValueError(
                f"read_into: chunks of {sum(len(c) for c in chunks)} bytes, a block has "
                f"{spec.nbytes}"
            )
        name = block_hash.hex()
        path = f"{self._dir}/{name[:2]}/{name}{SUFFIX}"  # self.path() as a str: no pathlib
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                data_offset, digest = self._read_header(fd, block_hash, spec)
                # One byte past the tensor: a longer file is not what its header says.
                num_read = _preadv_full(fd, [*chunks, bytearray(1)], data_offset)
            finally:
                os.close(fd)
            if num_read < spec.nbytes:
                raise CorruptBlockFile(f"truncated: {num_read} of {spec.nbytes} bytes")
            if num_read > spec.nbytes:
                raise CorruptBlockFile("longer than its header says")
            hasher = xxhash.xxh3_64()
            for chunk in chunks:
                hasher.update(chunk)
            if hasher.intdigest() != digest:
                raise CorruptBlockFile("checksum mismatch")
        except CorruptBlockFile as exc:
            logger.warning(
                "KV block file %s is corrupt (%s): treated as a miss and removed", name, exc
            )
            Path(path).unlink(missing_ok=True)
            raise

    def read(self, block_hash: bytes, spec: BlockSpec) -> torch.Tensor:
        """The block's K/V as a new CPU tensor (read_into one); the same errors."""
        kv = torch.empty(spec.shape, dtype=spec.dtype)
        self.read_into(block_hash, [tensor_bytes(kv)], spec)
        return kv

    def _read_header(self, fd: int, block_hash: bytes, spec: BlockSpec) -> tuple[int, int]:
        """(where the tensor bytes start, their digest), once the header is one of `spec`."""
        expected_len = self._header_lens.get(spec)
        if expected_len is None:
            expected_len = len(_header(b"\0" * 32, spec, 0)) - 8
            self._header_lens[spec] = expected_len
        head = os.pread(fd, 8 + expected_len, 0)
        if len(head) < 8:
            raise CorruptBlockFile("truncated header")
        (header_len,) = struct.unpack_from("<Q", head)
        if header_len > MAX_HEADER_BYTES:
            raise CorruptBlockFile(f"unreadable: a header of {header_len} bytes")
        if header_len != expected_len:  # another format or shape: read it to say which
            head = os.pread(fd, 8 + header_len, 0)
        try:
            header = json.loads(head[8 : 8 + header_len])
            metadata = header["__metadata__"]
            tensor = header["kv"]
        except Exception as exc:
            raise CorruptBlockFile(f"unreadable: {exc!r}") from None
        if metadata.get("format") != FORMAT:
            raise CorruptBlockFile(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        if metadata.get("block_hash") != block_hash.hex():
            raise CorruptBlockFile("it holds another block")
        expected = (SAFETENSORS_DTYPES.get(spec.dtype), list(spec.shape), [0, spec.nbytes])
        found = (tensor.get("dtype"), tensor.get("shape"), tensor.get("data_offsets"))
        if found != expected:
            raise CorruptBlockFile(
                f"it holds {found[0]} {found[1]}, the pool's blocks are {expected[0]} {expected[1]}"
            )
        try:
            digest = int(metadata["xxh3_64"], 16)
        except (KeyError, TypeError, ValueError):
            raise CorruptBlockFile("no digest") from None
        return 8 + header_len, digest

    # ------------------------------------------------------------------ housekeeping
    def remove(self, block_hash: bytes) -> int:
        """Delete a block's file; returns the bytes freed (0 if it was not there)."""
        path = self.path(block_hash)
        try:
            size = path.stat().st_size
            path.unlink()
            return size
        except FileNotFoundError:
            return 0

    def scan(self) -> list[tuple[bytes, int, float]]:
        """Every stored block: (hash, bytes, mtime), oldest first (leftover temp files removed)."""
        found = []
        for path in self.dir.glob("*/*" + SUFFIX):
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write that a crash interrupted
                continue
            try:
                stat = path.stat()
                found.append(
                    (bytes.fromhex(path.name[: -len(SUFFIX)]), stat.st_size, stat.st_mtime)
                )
            except (ValueError, FileNotFoundError):
                continue
        found.sort(key=lambda entry: entry[2])
        return found


def _header(block_hash: bytes, spec: BlockSpec, digest: int) -> bytes:
    """A safetensors header (length prefix, JSON padded with spaces to 8 bytes) for "kv"."""
    if spec.dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"KV block files: no safetensors dtype for {spec.dtype}")
    header = {
        "__metadata__": {
            "format": FORMAT,
            "block_hash": block_hash.hex(),
            "xxh3_64": f"{digest:016x}",
        },
        "kv": {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [0, spec.nbytes],
        },
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _preadv_full(fd: int, buffers: list, offset: int) -> int:
    """preadv into the buffers (IOV_MAX at a time) until they are full or the file ends;
    returns the bytes read. A read shorter than asked is the file's end (a regular file)."""
    if len(buffers) <= _IOV_MAX:
        return os.preadv(fd, buffers, offset)
    total = 0
    for start in range(0, len(buffers), _IOV_MAX):
        batch = buffers[start : start + _IOV_MAX]
        num_read = os.preadv(fd, batch, offset + total)
        total += num_read
        if num_read < sum(len(b) for b in batch):
            break
    return total
