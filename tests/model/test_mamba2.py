"""Mamba2's scan (model/mamba2.py): the chunked, state-space-dual form a prefill runs equals the
token-by-token recurrence a decode runs (the torch ops', and fused_ops.c's in place in a pool),
from any starting state and across pieces."""

from __future__ import annotations

import pytest
import torch

from tokenbus.model.layers import TORCH_OPS, FusedCpuOps
from tokenbus.model.mamba2 import Mamba2Mixer
from tokenbus.model.native import NativeBuildError, load_fused_ops
from tokenbus.model_arch import ModelArch

HEADS, DIM, STATE, GROUPS = 4, 8, 6, 2


def _mixer(chunk: int) -> Mamba2Mixer:
    arch = ModelArch(
        architecture="granitemoehybrid",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        recurrent_layers=(0,),
        conv_kernel=4,
        conv_bias=True,
        mamba_heads=HEADS,
        mamba_head_dim=DIM,
        mamba_state=STATE,
        mamba_groups=GROUPS,
        mamba_chunk=chunk,
    )
    return Mamba2Mixer(arch)


def _inputs(length: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(length)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    x, b, c = randn(length, HEADS, DIM), randn(length, GROUPS, STATE), randn(length, GROUPS, STATE)
    dt = torch.rand(length, HEADS, generator=generator, dtype=torch.float64).to(dtype)
    a = (-torch.rand(HEADS, generator=generator, dtype=torch.float64) * 2).to(dtype)
    return x, dt, a, b, c, randn(HEADS, DIM, STATE)


@pytest.mark.parametrize(("length", "chunk"), [(1, 8), (7, 8), (8, 8), (21, 8), (21, 64)])
def test_chunked_scan_equals_the_recurrence(length, chunk):
    x, dt, a, b, c, s0 = _inputs(length, torch.float64)
    d = torch.zeros(HEADS, dtype=torch.float64)
    pool = torch.zeros(3, HEADS, DIM, STATE, dtype=torch.float64)
    pool[1] = s0  # one request in row 1, decoding token by token
    rows = torch.tensor([1])
    ys = [
        TORCH_OPS.ssm_decode_step_(
            pool, rows, x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], d
        )
        for t in range(length)
    ]
    y_chunked, s_chunked = _mixer(chunk)._chunked(x, dt, a, b, c, s0)
    torch.testing.assert_close(y_chunked, torch.cat(ys), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_chunked, pool[1], rtol=1e-10, atol=1e-10)
    assert pool[0].eq(0).all() and pool[2].eq(0).all()


def test_the_c_step_is_the_torch_step():
    """fused_ops.c's ssm_decode_step: three requests in rows 3, 0, 2 of a pool whose rows are
    strided (a flat row holds more than S), x / B / C as strided views, D's skip."""
    try:
        ops = FusedCpuOps(load_fused_ops())
    except NativeBuildError as exc:
        pytest.skip(f"fused_ops.c does not build here: {exc}")
    x, dt, a, b, c, _ = _inputs(3, torch.float32)
    d = torch.randn(HEADS, generator=torch.Generator().manual_seed(1))
    flat = torch.randn(4, 7 + HEADS * DIM * STATE, generator=torch.Generator().manual_seed(2))
    states = flat[:, 7:].view(4, HEADS, DIM, STATE)  # rows strided by the flat row
    wide = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    x = wide[:, : HEADS * DIM].view(3, HEADS, DIM).copy_(x)  # strided rows, as the conv's split
    rows = torch.tensor([3, 0, 2])
    before = flat.clone()
    want_states = states.clone()
    want = TORCH_OPS.ssm_decode_step_(want_states, rows, x, dt, a, b, c, d)
    got = ops.ssm_decode_step_(states, rows, x, dt, a, b, c, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)
    assert torch.equal(flat[1], before[1]) and torch.equal(flat[:, :7], before[:, :7])
