"""Gated DeltaNet's recurrence (model/gated_delta_net.py): the torch path (decodes batched,
chunks in the chunked form, piece after piece: layers/delta_rule.py) and fused_ops.c's token
loop, in place in a pool, equal HF's token-by-token reference and its chunked form for any mix
of decodes and chunks; value heads read their key heads grouped (HF's order) or tiled
(llama.cpp's reordered GGUF), the same computation with the heads permuted."""

from __future__ import annotations

import pytest
import torch

from tokenbus.model.layers import TORCH_OPS, FusedCpuOps
from tokenbus.model.native import NativeBuildError, load_fused_ops

K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 8, 16
ROWS = torch.tensor([3, 1, 1, 1, 1, 1, 0, 0])  # a decode, a 5-token chunk, a 2-token chunk


def _inputs(tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q = torch.nn.functional.normalize(randn(tokens, K_HEADS, K_DIM), dim=-1) * K_DIM**-0.5
    k = torch.nn.functional.normalize(randn(tokens, K_HEADS, K_DIM), dim=-1)
    v = randn(tokens, V_HEADS, V_DIM)
    g = -torch.rand(tokens, V_HEADS, generator=generator) * 2
    beta = torch.rand(tokens, V_HEADS, generator=generator)
    return q, k, v, g, beta, randn(5, V_HEADS, K_DIM, V_DIM)


def _fused_ops() -> FusedCpuOps:
    try:
        return FusedCpuOps(load_fused_ops())
    except NativeBuildError as exc:
        pytest.skip(f"fused_ops.c unavailable: {exc}")


@pytest.mark.parametrize("ops", ["torch", "c"])
def test_steps_equal_hfs_recurrence_and_chunked_form(ops):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    run = TORCH_OPS if ops == "torch" else _fused_ops()
    q, k, v, g, beta, s0 = _inputs(len(ROWS))
    pool = s0.clone()
    out = run.gated_delta_rule_(pool, ROWS, q, k, v, g, beta, False)
    for row in (3, 1, 0):
        mine = torch.nonzero(ROWS == row).flatten()
        args = (q[mine][None] * K_DIM**0.5, k[mine][None], v[mine][None])  # HF scales q itself
        for reference in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
            want, state = reference(
                *args, g=g[mine][None], beta=beta[mine][None],
                initial_state=s0[row : row + 1].clone(), output_final_state=True,
            )  # fmt: skip
            torch.testing.assert_close(out[mine], want[0], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(pool[row], state[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool[[2, 4]], s0[[2, 4]], atol=0, rtol=0)  # other rows untouched


@pytest.mark.parametrize("ops", ["torch", "c"])
def test_tiled_heads_are_the_grouped_ones_permuted(ops):
    """Value head j reads key head j // 2 grouped, j % 2 tiled: putting the grouped heads in
    tiled order (0, 2, 1, 3) gives the same outputs and states, permuted."""
    run = TORCH_OPS if ops == "torch" else _fused_ops()
    q, k, v, g, beta, s0 = _inputs(len(ROWS), seed=1)
    tiled = torch.tensor([0, 2, 1, 3])  # tiled head i is grouped head tiled[i]
    grouped_pool, tiled_pool = s0.clone(), s0[:, tiled].clone()
    want = run.gated_delta_rule_(grouped_pool, ROWS, q, k, v, g, beta, False)
    got = run.gated_delta_rule_(
        tiled_pool, ROWS, q, k, v[:, tiled], g[:, tiled], beta[:, tiled], True
    )
    torch.testing.assert_close(got, want[:, tiled], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tiled_pool, grouped_pool[:, tiled], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("length", [63, 64, 65, 150])
def test_chunked_pieces_carry_the_state_across(length):
    """A run longer than a piece (layers/delta_rule.py's CHUNK tokens) carries S from piece to
    piece; a decode after it (another row) joins no piece. The torch path equals the C loop."""
    q, k, v, g, beta, s0 = _inputs(length + 1, seed=length)
    rows = torch.tensor([2] * length + [4])
    pools = {ops: s0.clone() for ops in ("torch", "c")}
    outs = {
        ops: run.gated_delta_rule_(pools[ops], rows, q, k, v, g, beta, False)
        for ops, run in (("torch", TORCH_OPS), ("c", _fused_ops()))
    }
    torch.testing.assert_close(outs["torch"], outs["c"], atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(pools["torch"], pools["c"], atol=5e-5, rtol=5e-5)
