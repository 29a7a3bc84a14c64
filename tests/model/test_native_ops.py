"""The native kernels as torch custom ops."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from tests.model.test_native_attention import make_batch

from tokenbus.model.attention import build_attention_plan, paged_attention
from tokenbus.model.native import TILE_GEMV_MAX_ROWS, load_paged_attention, load_quant_kernels
from tokenbus.model.native import ops as native_ops

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the native kernels cannot be built here",
)


@needs_cc
def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations and mutation declarations are what torch.compile
    relies on: torch.library.opcheck checks each against the real kernel."""
    import gguf

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
    qtype = gguf.GGMLQuantizationType.Q8_0
    w = torch.from_numpy(
        gguf.quants.quantize(
            np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32), qtype
        )
    )
    tiles = load_quant_kernels().repack_tiles(int(qtype), w, 64)
    for rows in (3, TILE_GEMV_MAX_ROWS + 2):  # the block kernels, then dequantize + GEMM
        torch.library.opcheck(
            native_ops.quant_matmul, (torch.randn(rows, 64), w, int(qtype), 64, 40, False, "fp32")
        )
        for activations in ("fp32", "int16", "int8"):  # 16-row tiles
            torch.library.opcheck(
                native_ops.quant_matmul,
                (torch.randn(rows, 64), tiles, int(qtype), 64, 40, True, activations),
            )
    for weight, tiled in ((w, False), (tiles, True)):
        torch.library.opcheck(
            native_ops.dequant_rows, (weight, int(qtype), 64, 40, tiled, torch.tensor([3, 0, 39]))
        )


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
