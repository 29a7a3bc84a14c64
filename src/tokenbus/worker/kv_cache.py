"""Sizing and allocating the paged KV cache tensors (L3)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from tokenbus.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig
from tokenbus.core.kv.hybrid import KVGroupLayout
from tokenbus.model.kv_quant import row_width
from tokenbus.model_arch import ModelArch
from tokenbus.utils import cdiv


def bytes_per_block(
    arch: ModelArch, block_size: int, dtype: torch.dtype, groups: KVGroupLayout | None = None
) -> int:
    """A block's K and V over all layers in a pool of `dtype` (its real bytes: q8_0 rows hold
    their scales, model/kv_quant.py); under a hybrid KV cache (`groups`) over its buffers only
    (a layer of each group of one K/V shape): a block is a page of the shared buffers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    layers = arch.kv_layers if groups is None else groups.buffer_layers
    return sum(
        2 * heads * row_width(dtype, dim) * element_size * block_size
        for heads, dim in map(arch.kv_shape, layers)
    )


def determine_num_blocks(
    cache: CacheConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    reserved_bytes: int = 0,
    groups: KVGroupLayout | None = None,
    draft_arch: ModelArch | None = None,
) -> int:
    """Blocks that fit the KV budget, less `reserved_bytes` (CUDA graphs) of a profiled budget;
    fails if one max_model_len request cannot fit (in every KV group: a whole-prompt prefill
    holds all its blocks in a sliding group too, until the next step frees them). A separate
    draft model's cache (`draft_arch`: a rank's share) holds the same block ids: its layers
    count in each block's bytes."""
    per_block = bytes_per_block(arch, cache.block_size, dtype, groups)
    if draft_arch is not None:
        per_block += bytes_per_block(draft_arch, cache.block_size, dtype)
    num_groups = 1 if groups is None else len(groups.groups)
    # one full-length request + the null block
    needed = num_groups * cdiv(max_model_len, cache.block_size) + 1
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        budget = _kv_budget_bytes(cache, device)
        if cache.kv_cache_memory is None:
            budget = max(0, budget - reserved_bytes)
        num_blocks = budget // per_block
        if cache.kv_cache_memory is None:
            # The default never exceeds what max_num_seqs full-length requests could use (a tiny
            # model would otherwise get millions of blocks).
            num_blocks = min(num_blocks, max_num_seqs * (needed - 1) + 1)
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory: {num_blocks} KV blocks ({num_blocks * per_block / 2**20:.1f} MiB) "
            f"cannot hold one request of max_model_len={max_model_len} tokens, which needs "
            f"{needed} blocks ({needed * per_block / 2**20:.1f} MiB). Raise --kv-cache-memory or "
            f"lower --max-model-len."
        )
    return num_blocks


def _kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if device.type == "cuda":
        # Weights are loaded before sizing, so what is free now minus the headroom left by
        # gpu_memory_utilization (activations of one max-sized step) is the KV budget. Blocks
        # freed while loading (per-expert tensors replaced by stacked ones: model/moe.py) sit in
        # torch's allocator cache until handed back, and would count as used.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        reserve = int(total * (1.0 - cache.gpu_memory_utilization))
        return max(0, free - reserve)
    return DEFAULT_CPU_KV_CACHE_MEMORY


def allocate_kv_caches(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    groups: KVGroupLayout | None = None,
    state_pools: Mapping[int, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, row] (row:
    head_dim elements, or a q8_0 row's bytes: model/kv_quant.py), of that layer's K/V shape
    (ModelArch.kv_shape). Under a hybrid KV cache (`groups`) one per buffer, shared: a layer
    gets the buffer groups.place names. A recurrent layer (arch.recurrent_layers) holds no K/V:
    its entry is its pool from `state_pools` (worker/state_pool.py); an MLP-only layer's
    (arch.mlp_only_layers) is an empty tensor; a layer reading another's K/V
    (arch.kv_shared_layers) gets its owner's tensor."""
    state_pools = state_pools or {}
    if set(state_pools) != set(arch.recurrent_layers):
        raise ValueError(f"recurrent layers {arch.recurrent_layers} need their state pools")
    if arch.kv_shared_layers and (arch.recurrent_layers or arch.mlp_only_layers):
        raise ValueError("layers sharing K/V beside recurrent or MLP-only layers")

    def pool(layer: int) -> torch.Tensor:
        heads, dim = arch.kv_shape(layer)
        shape = (2, num_blocks, block_size, heads, row_width(dtype, dim))
        if device.type == "cpu":
            return _lazy_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    if groups is None:
        tensors = {layer: pool(layer) for layer in arch.kv_layers}
    else:  # a buffer takes the K/V shape of the layers it holds
        buffers = [pool(layer) for layer in groups.buffer_layers]
        tensors = {layer: buffers[groups.place(layer)[1]] for layer in arch.kv_layers}
    empty = torch.empty(0, dtype=dtype, device=device)
    return [
        state_pools[i]
        if i in state_pools
        else empty
        if i in arch.mlp_only_layers
        else tensors[arch.kv_owner(i)]
        for i in range(arch.num_hidden_layers)
    ]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages become resident only when first written: numpy's zeros is calloc,
    which maps fresh zero pages for large sizes, where torch.zeros writes every byte (the whole
    pool's start-up time and RSS before any request: benchmarks/startup_profile.py)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    num_bytes = element_size * math.prod(shape)
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
