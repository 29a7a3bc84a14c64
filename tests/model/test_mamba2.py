"""Mamba2's scan (model/mamba2.py): the chunked, state-space-dual form a prefill runs equals the
token-by-token recurrence a decode runs, from any starting state and across pieces."""

from __future__ import annotations

import pytest
import torch

from tokenbus.model.mamba2 import Mamba2Mixer
from tokenbus.model_arch import ModelArch


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
        mamba_heads=4,
        mamba_head_dim=8,
        mamba_state=6,
        mamba_groups=2,
        mamba_chunk=chunk,
    )
    return Mamba2Mixer(arch)


@pytest.mark.parametrize(("length", "chunk"), [(1, 8), (7, 8), (8, 8), (21, 8), (21, 64)])
def test_chunked_scan_equals_the_recurrence(length, chunk):
    mixer = _mixer(chunk)
    generator = torch.Generator().manual_seed(length)
    heads, dim, state, groups = 4, 8, 6, 2

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x, b, c = randn(length, heads, dim), randn(length, groups, state), randn(length, groups, state)
    dt = torch.rand(length, heads, generator=generator, dtype=torch.float64)
    a = -torch.rand(heads, generator=generator, dtype=torch.float64) * 2
    s0 = randn(heads, dim, state)
    ys, s = [], s0[None]
    for t in range(length):  # decode steps, one request
        y, s = mixer._step(x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], s)
        ys.append(y)
    y_chunked, s_chunked = mixer._chunked(x, dt, a, b, c, s0)
    torch.testing.assert_close(y_chunked, torch.cat(ys), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_chunked, s[0], rtol=1e-10, atol=1e-10)
