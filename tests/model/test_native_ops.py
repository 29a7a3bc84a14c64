"""The native kernels as torch custom ops."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tests.model.test_native_attention import make_batch

from tokenbus.model.attention import build_attention_plan, paged_attention
from tokenbus.model.native import load_paged_attention
from tokenbus.model.native import ops as native_ops

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the native kernels cannot be built here",
)


@needs_cc
def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations and mutation declarations are what torch.compile
    relies on: torch.library.opcheck checks each against the real kernel."""

    q, k, v, kv, ctx = make_batch([(1, 20), (3, 5)], 9, 3, 64)
    starts = torch.tensor(ctx.query_start_loc)
    torch.library.opcheck(
        native_ops.paged_attention,
        (
            q.contiguous(),
            kv,
            ctx.block_tables.contiguous(),
            starts,
            ctx.seq_lens_t,
            torch.arange(2),
            0.125,
        ),
    )
    torch.library.opcheck(native_ops.write_kv, (kv.clone(), k, v, ctx.slot_mapping))


@needs_cc
def test_custom_ops_equal_the_eager_kernels():
    q, k, v, kv, ctx = make_batch([(1, 20), (1, 0), (4, 30)], 9, 3, 64)
    plan = build_attention_plan(ctx, torch.float32, load_paged_attention())
    ref = paged_attention(q, k, v, kv.clone(), ctx.slot_mapping, plan, 0.125)
    cache = kv.clone()
    native_ops.write_kv(cache, k, v, ctx.slot_mapping)
    out = native_ops.paged_attention(
        q,
        cache,
        ctx.block_tables,
        torch.tensor(ctx.query_start_loc),
        ctx.seq_lens_t,
        torch.arange(3),
        0.125,
    )
    assert torch.equal(out, ref)
