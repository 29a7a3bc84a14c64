"""The native CPU kernels as torch custom ops (`torch.library.custom_op`), each with a fake
implementation that gives only the output's shape and dtype, so torch.compile traces a call as
one opaque node instead of breaking the graph at a ctypes call.

    tokenbus::write_kv(kv_cache!, k, v, slot_mapping)             (in place, see attention.write_kv)
    tokenbus::paged_attention(q, kv_cache, block_tables, query_start, seq_lens, reqs, scale) -> out

Eager code calls the kernels directly (a custom op's dispatch costs microseconds per call, and
a decode step makes ~150 of them); the static decode plan (attention.NativeDecodePlan) calls
these. The kernel is loaded on first call, once per process.
"""

from __future__ import annotations

import functools

import torch

from tokenbus.model.native import PagedAttentionKernel, check_indices


@functools.cache
def _attention_kernel() -> PagedAttentionKernel:
    from tokenbus.model.native import load_paged_attention

    return load_paged_attention()


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t [T, H, D] laid out as the kernel reads it: heads D apart, unit stride within a head (any
    token stride)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


@torch.library.custom_op("tokenbus::write_kv", mutates_args=("kv_cache",))
def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, Hkv, D] into kv_cache [2, NB, bs, Hkv, D] at `slot_mapping`, in place. An op of
    its own because traced as index_copy_ on a view of a graph input, the compiler copies the
    whole cache out and back around every write."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, NB * bs, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))  # rounded to the cache's dtype
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


@write_kv.register_fake
def _(kv_cache, k, v, slot_mapping):
    return None


@torch.library.custom_op("tokenbus::paged_attention", mutates_args=(), device_types="cpu")
def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    reqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """out [T, Hq, D]: rows of the requests `reqs` attended (paged_attention.c), other rows 0."""
    out = torch.zeros(q.shape, dtype=q.dtype)
    index = [t.contiguous() for t in (reqs, query_start, seq_lens, block_tables)]
    check_indices(*index)
    reqs, query_start, seq_lens, block_tables = index
    _attention_kernel()(
        _rows_contiguous(q),
        kv_cache.contiguous(),
        block_tables,
        query_start,
        seq_lens,
        reqs,
        scale,
        out,
    )
    return out


@paged_attention.register_fake
def _(q, kv_cache, block_tables, query_start, seq_lens, reqs, scale):
    return q.new_empty(q.shape)
