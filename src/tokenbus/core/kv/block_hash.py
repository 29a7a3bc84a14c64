"""Chained, stable hashes of full KV blocks (the keys of the prefix cache).

``hash(block i) = sha256(hash(block i-1) ‖ token ids of block i ‖ extra keys)``, so a block's
hash names its whole prefix: equal hashes mean equal tokens from position 0 (up to sha256
collisions). The byte encoding is canonical (tagged, length-prefixed, little-endian), so a
hash is the same in every process and run, whatever PYTHONHASHSEED: never ``hash()`` or pickle.
Changing the encoding changes every hash; do it knowingly (external KV stores may keep them).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence, Sized
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbus.core.request import Request

# The parent of a request's first block: a fixed seed, not a per-process random value, so that
# hashes can be compared across processes (data-parallel engines, KV connectors).
NONE_HASH: bytes = hashlib.sha256(b"tokenbus-none-hash").digest()
HASH_NUM_BYTES = 32


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """The 32-byte sha256 of one full block given its parent's hash (None for the first)."""
    if parent_hash is None:
        parent_hash = NONE_HASH
    if len(parent_hash) != HASH_NUM_BYTES:  # fixed width: the encoding needs no length prefix
        raise ValueError(f"parent_hash must be {HASH_NUM_BYTES} bytes, got {len(parent_hash)}")
    hasher = hashlib.sha256(parent_hash)
    hasher.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    hasher.update(_encode(extra_keys))
    return hasher.digest()


def block_extra_keys(request: Request, block_index: int) -> tuple | None:
    """Whatever besides token ids decides the KV of block ``block_index``; None if nothing.

    On the first block only, since every later hash chains from it: the tenant's
    ``cache_salt`` and the LoRA adapter (name and path: an adapter's K/V differ from the base
    model's and from any other adapter's). Multimodal ``(mm_hash, offset)`` pairs (the blocks
    an image overlaps) belong here too, when requests carry them.
    """
    if block_index != 0:
        return None
    keys: list = []
    if request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    if request.lora_request is not None:
        keys.append(("lora", request.lora_request.lora_name, request.lora_request.lora_path))
    return tuple(keys) if keys else None


def hash_new_full_blocks(request: Request, block_size: int) -> list[bytes]:
    """Hashes of the request's full blocks that ``request.block_hashes`` does not hold yet.

    Only ``all_token_ids`` (prompt + accepted outputs) are hashed, never draft tokens; a
    trailing partial block is hashed once a later call finds it full.
    """
    num_hashed = len(request.block_hashes)
    num_full_blocks = request.num_tokens // block_size
    parent = request.block_hashes[-1] if num_hashed else None
    new_hashes: list[bytes] = []
    for i in range(num_hashed, num_full_blocks):
        # Block i holds tokens [i * block_size, (i + 1) * block_size).
        tokens = request.all_token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, tokens, block_extra_keys(request, i))
        new_hashes.append(parent)
    return new_hashes


def make_block_hasher(block_size: int) -> Callable[[Request], list[bytes]]:
    """The ``block_hasher`` callback a ``Request`` calls to extend its ``block_hashes``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return functools.partial(hash_new_full_blocks, block_size=block_size)


def _encode(value: object) -> bytes:
    """Injective, type-tagged bytes for the values extra keys may hold."""
    if value is None:
        return b"N"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return b"B\x01" if value else b"B\x00"
    if isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"I" + _length(raw) + raw
    if isinstance(value, float):
        return b"F" + struct.pack("<d", value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"S" + _length(raw) + raw
    if isinstance(value, bytes):
        return b"Y" + _length(value) + value
    if isinstance(value, (tuple, list)):
        return b"T" + _length(value) + b"".join(_encode(item) for item in value)
    raise TypeError(f"cannot hash an extra key of type {type(value).__name__}: {value!r}")


def _length(value: Sized) -> bytes:
    return struct.pack("<Q", len(value))
