"""One K/V block (every layer) per safetensors file, keyed by its block hash (L2).

    <root>/<layout fingerprint>/<hash[:2]>/<hash hex>.safetensors

A file holds one tensor "kv" [num_layers, 2, block_size, num_kv_heads, head_dim] and metadata:
the format, the block hash and a CRC-32 of the tensor bytes. Writes go to a temporary file in
the same directory and are renamed into place, so a crash leaves either the whole file or none;
a file that does not parse, names another hash or fails its checksum is a miss (and removed),
never K/V loaded into the pool.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

logger = logging.getLogger(__name__)

FORMAT = "tokenbus-kv-block-1"
SUFFIX = ".safetensors"


class CorruptBlockFile(Exception):
    """A block file that must not be loaded (truncated, altered, or another block's)."""


class BlockFiles:
    def __init__(self, root: str | os.PathLike, layout_fingerprint: str) -> None:
        self.dir = Path(root) / layout_fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def exists(self, block_hash: bytes) -> bool:
        return self.path(block_hash).is_file()

    def write(self, block_hash: bytes, kv: torch.Tensor) -> int:
        """Store one block's K/V (any device); returns the file's size in bytes."""
        kv = kv.detach().to("cpu").contiguous()
        metadata = {
            "format": FORMAT,
            "block_hash": block_hash.hex(),
            "crc32": str(zlib.crc32(_tensor_bytes(kv))),
        }
        data = save_safetensors({"kv": kv}, metadata=metadata)
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old state or the whole new file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(data)

    def read(self, block_hash: bytes) -> torch.Tensor:
        """The block's K/V; FileNotFoundError if absent, CorruptBlockFile (file removed) if bad."""
        path = self.path(block_hash)
        data = path.read_bytes()
        try:
            return _parse(data, block_hash)
        except CorruptBlockFile as exc:
            logger.warning(
                "KV block file %s is corrupt (%s): treated as a miss and removed", path.name, exc
            )
            path.unlink(missing_ok=True)
            raise

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


def _tensor_bytes(kv: torch.Tensor) -> bytes:
    return (
        kv.view(torch.uint8).numpy().tobytes()
        if kv.dtype == torch.bfloat16
        else kv.numpy().tobytes()
    )


def _parse(data: bytes, block_hash: bytes) -> torch.Tensor:
    if len(data) < 8:
        raise CorruptBlockFile("truncated header")
    (header_len,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + header_len])
        metadata = header.get("__metadata__", {})
        kv = load_safetensors(data)["kv"]
    except Exception as exc:  # safetensors raises its own error types for bad files
        raise CorruptBlockFile(f"unreadable: {exc}") from None
    if metadata.get("format") != FORMAT:
        raise CorruptBlockFile(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
    if metadata.get("block_hash") != block_hash.hex():
        raise CorruptBlockFile("it holds another block")
    if metadata.get("crc32") != str(zlib.crc32(_tensor_bytes(kv))):
        raise CorruptBlockFile("checksum mismatch")
    return kv
