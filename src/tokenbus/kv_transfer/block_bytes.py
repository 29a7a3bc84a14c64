"""Blocks as byte ranges (L2): where a load writes a block's K/V, with no tensor in between.

A block over every layer is [num_layers, 2, block_size, Hkv, row] (a block file's order; row:
the pool's last dimension). In a pool of per-layer tensors [2, num_blocks, block_size, Hkv,
row] it lies in 2·num_layers ranges of block_size·Hkv·row elements, each layer's K then V:
`PoolBytes.block_chunks` names them, so a load reads or copies into the pool itself. A pool
that is not such CPU memory (a GPU's) gets its blocks through `StagedBlocks`, a host tensor
written into it by one write_blocks.

Copies here are memcpy through memoryviews: single-threaded, and never an OpenMP parallel
region, whose two threads on two shared cores can wait on each other for milliseconds per op.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenbus.kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class BlockSpec:
    """One block over every layer as the pool holds it: [L, 2, block_size, Hkv, row] of the
    pool tensors' dtype (row: the pool's last dimension, head_dim unless K/V are quantized)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int = field(init=False, compare=False)  # read per block: computed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @classmethod
    def of_pool(cls, kv_caches: list[torch.Tensor]) -> BlockSpec:
        """From per-layer pool tensors [2, num_blocks, block_size, Hkv, row]."""
        return cls(kv_caches[0].dtype, (len(kv_caches), 2, *kv_caches[0].shape[2:]))


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's storage as a flat byte view (shared, not copied)."""
    return memoryview(kv.view(torch.uint8).numpy()).cast("B")


def copy_into(chunks: Sequence[memoryview], kv: torch.Tensor) -> None:
    """Copy a block's K/V [L, 2, bs, Hkv, row] (a CPU tensor) into its byte ranges, in order."""
    src = tensor_bytes(kv.detach().contiguous())
    if len(src) != sum(len(chunk) for chunk in chunks):
        raise ValueError(
            f"a block of {len(src)} bytes into {sum(len(c) for c in chunks)} bytes of pool"
        )
    offset = 0
    for chunk in chunks:
        chunk[:] = src[offset : offset + len(chunk)]
        offset += len(chunk)


class PoolBytes:
    """A CPU pool's per-layer tensors as flat byte views, for loads straight into the pool."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self._layers = [tensor_bytes(cache) for cache in kv_caches]
        self._addresses = [cache.data_ptr() for cache in kv_caches]
        self._num_blocks = kv_caches[0].shape[1]
        self._chunk_nbytes = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], layout: KVLayout) -> PoolBytes | None:
        """None unless the layers are contiguous CPU tensors [2, num_blocks, bs, Hkv, row] of
        one shape and dtype whose blocks are the layout's size (then loads are staged)."""
        first = kv_caches[0] if kv_caches else None
        if first is None or first.dim() != 5 or first.shape[0] != 2:
            return None
        if BlockSpec.of_pool(kv_caches).nbytes != layout.block_nbytes:
            return None
        for cache in kv_caches:
            if (
                cache.device.type != "cpu"
                or cache.shape != first.shape
                or cache.dtype != first.dtype
                or not cache.is_contiguous()
            ):
                return None
        return cls(kv_caches)

    def block_chunks(self, block_id: int) -> list[memoryview]:
        """Block `block_id`'s 2·L byte ranges in [L, 2, bs, Hkv, row] order."""
        size = self._chunk_nbytes
        k_start = block_id * size
        v_start = (self._num_blocks + block_id) * size
        chunks = []
        for layer in self._layers:
            chunks.append(layer[k_start : k_start + size])
            chunks.append(layer[v_start : v_start + size])
        return chunks

    def prefault(self, first_block: int, num_blocks: int) -> bool:
        """Make blocks [first_block, first_block + num_blocks) of every layer resident without
        writing them (MADV_POPULATE_WRITE: page tables only, safe beside the engine's writes).
        False where the kernel cannot (before Linux 5.14). A fresh pool's pages are mapped on
        first write, in 2 MiB pages where numpy asked for them: on the first load after a start
        that costs several times the copy itself."""
        num_blocks = min(num_blocks, self._num_blocks - first_block)
        if num_blocks <= 0:
            return True
        for address in self._addresses:
            for half in (0, self._num_blocks):  # K, then V
                start = address + (half + first_block) * self._chunk_nbytes
                end = start + num_blocks * self._chunk_nbytes
                start -= start % mmap.PAGESIZE
                if _madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                    return False
        return True


_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)


def _madvise(address: int, length: int, advice: int) -> int:
    """libc's madvise; -1 where it fails or there is none (not Linux)."""
    libc = _libc()
    return -1 if libc is None else libc.madvise(address, length, advice)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


class StagedBlocks:
    """`num_blocks` blocks in a host tensor [L, 2, num_blocks, bs, Hkv, row], write_blocks'
    input."""

    def __init__(self, spec: BlockSpec, num_blocks: int) -> None:
        num_layers, _, *block = spec.shape
        self.tensor = torch.empty(num_layers, 2, num_blocks, *block, dtype=spec.dtype)
        self._bytes = tensor_bytes(self.tensor)
        self._num_blocks = num_blocks
        self._chunk_nbytes = math.prod(block) * spec.dtype.itemsize

    def block_chunks(self, index: int) -> list[memoryview]:
        """The index-th block's 2·L byte ranges in [L, 2, bs, Hkv, row] order."""
        size = self._chunk_nbytes
        starts = (
            (layer_kv * self._num_blocks + index) * size
            for layer_kv in range(self.tensor.shape[0] * 2)
        )
        return [self._bytes[start : start + size] for start in starts]
