"""Attention whose result for a query does not depend on its step (--batch-invariant), L2.

The native kernel has two paths: a decode path (paged_attention) for requests of up to
NATIVE_MAX_QUERY_LEN queries, which on every ISA computes each query row as a decode of the keys
it sees, and a flash path (paged_prefill_attention) for longer chunks, whose online softmax sums
in another order and whose rows also differ with where the chunk starts. So by default a prompt
token's attention output changes with the chunk it lands in, and with whether its prefix came
from the cache (a short remainder: the decode path) or from the same chunk (the flash path).

This plan sends every query to the decode path: a long request is cut into pieces of at most
NATIVE_MAX_QUERY_LEN queries, each a request of its own over the same block table (piece
[a, b) of a request with q_len queries and seq_len keys has seq_len - (q_len - b) keys: query i
still sees keys 0 .. seq_len - q_len + i). Pieces only add work items; no row's sums change
(tests/model/test_batch_invariant.py). The cost: a prefill chunk reads each key once per query
token instead of once per 32 (docs/benchmarks.md, "Batch invariance").
"""

from __future__ import annotations

import torch

from tokenbus.model.attention import (
    NATIVE_MAX_QUERY_LEN,
    AttentionPlan,
    NativeBatch,
    check_indices,
)
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.native import KERNEL_KV_DTYPES, PagedAttentionKernel


def row_invariant_plan(
    ctx: ForwardContext, kernel: PagedAttentionKernel, dtype: torch.dtype
) -> AttentionPlan:
    """Every request of the step on the native kernel's decode path, long ones in pieces."""
    kv = ctx.first_kv_cache
    if kv.device.type != "cpu" or kv.dtype not in KERNEL_KV_DTYPES.get(dtype, ()):
        raise ValueError(
            f"batch_invariant: the native attention kernel does not read {kv.dtype} K/V under "
            f"{dtype} queries on {kv.device.type}"
        )
    starts, seq_lens = ctx.query_start_loc, ctx.seq_lens
    piece_starts, piece_seq_lens, piece_reqs, run = [0], [], [], []
    for r in range(ctx.num_reqs):
        start, end = starts[r], starts[r + 1]
        # [a, b) pieces of at most NATIVE_MAX_QUERY_LEN queries; a request with none keeps one
        # empty piece, so piece boundaries stay the step's token order.
        bounds = list(range(start, end, NATIVE_MAX_QUERY_LEN))[1:] + [end]
        for b in bounds:
            # padding requests (no keys) keep their zero rows
            if b > piece_starts[-1] and seq_lens[r] > 0:
                run.append(len(piece_reqs))
            piece_reqs.append(r)
            piece_seq_lens.append(seq_lens[r] - (end - b))
            piece_starts.append(b)
    if len(piece_reqs) == ctx.num_reqs:  # nothing was cut: the step's own tensors
        query_start = torch.tensor(starts, dtype=torch.int64)
        seq_lens_t, tables = ctx.seq_lens_t, ctx.block_tables
    else:
        query_start = torch.tensor(piece_starts, dtype=torch.int64)
        seq_lens_t = torch.tensor(piece_seq_lens, dtype=torch.int64)
        tables = ctx.block_tables.index_select(0, torch.tensor(piece_reqs, dtype=torch.int64))
    native = None
    if run:
        reqs = torch.tensor(run, dtype=torch.int64)
        check_indices(query_start, seq_lens_t, tables, reqs)
        native = NativeBatch(kernel, reqs, query_start, seq_lens_t, tables)
    return AttentionPlan([], [], ctx.num_tokens, native)
