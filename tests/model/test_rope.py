"""Rotary tables against transformers' own RoPE functions (ROPE_INIT_FUNCTIONS), bit for bit:
YaRN (with and without mscale, truncation, explicit attention factor), LongRoPE (short and long
factor sets, the attention factor from max / original positions), partial rotary; and the
partial rotation itself against HF Phi3's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from tokenbus.model.layers.rotary import RotaryEmbedding, apply_rotary, compute_rope

HEAD_DIM = 32  # hidden 128 / 4 heads
YARN_CASES = {
    "plain": {"factor": 4.0, "original_max_position_embeddings": 128},
    "betas": {
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "mscale": {
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "attention_factor": {
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 1.3,
    },
    "no_truncate": {"factor": 2.0, "original_max_position_embeddings": 256, "truncate": False},
}


def hf_rope(config) -> tuple[torch.Tensor, float]:
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_matches_transformers(case):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN_CASES[case]}
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
    )
    want, want_factor = hf_rope(config)
    got, got_factor = compute_rope(HEAD_DIM, 10000.0, params, 512)
    assert torch.equal(got, want)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    assert got_factor != 1.0 or case == "no_truncate"  # the attention factor is in play


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("regime", ["short", "long"])
def test_longrope_matches_transformers_each_factor_set(partial, regime):
    """transformers picks the set per forward from its longest position: `seq_len` past the
    original context gives the long factors; we pick it from the table's length."""
    dim = int(HEAD_DIM * partial)
    short = [1.0 + 0.1 * i for i in range(dim // 2)]
    long = [1.0 + 2.0 * i for i in range(dim // 2)]
    config = Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=1024,
        original_max_position_embeddings=64,
        partial_rotary_factor=partial,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
    )
    seq_len = 65 if regime == "long" else 64
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 64,
        "factor": 1024 / 64,  # what hf_loader fills in
    }
    got, got_factor = compute_rope(dim, 10000.0, scaling, max_position=seq_len)
    assert torch.equal(got, want)
    assert got_factor == want_factor > 1.0


def test_longrope_factor_count_is_checked():
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 3,
        "long_factor": [1.0] * 3,
        "original_max_position_embeddings": 64,
        "factor": 2.0,
    }
    with pytest.raises(ValueError, match=r"rope_scaling.short_factor: expected 8 values"):
        compute_rope(16, 10000.0, scaling, 64)


def test_partial_rotary_turns_the_first_dims_as_hf_phi3():
    torch.manual_seed(0)
    rotary = RotaryEmbedding(16, 64, 10000.0, None, rotary_dim=12)
    positions = torch.tensor([0, 5, 63])
    cos, sin = rotary.lookup(positions, torch.float32)  # [T, 1, 6]
    x = torch.randn(3, 4, 16)  # [T, H, D]
    got = apply_rotary(x, cos, sin)
    full_cos, full_sin = torch.cat((cos, cos), -1)[:, 0], torch.cat((sin, sin), -1)[:, 0]  # [T, R]
    heads_first = x.transpose(0, 1)[None]  # HF's [B, H, T, D]
    want, _ = apply_rotary_pos_emb(heads_first, heads_first, full_cos[None], full_sin[None])
    assert torch.equal(got, want[0].transpose(0, 1))
    assert torch.equal(got[..., 12:], x[..., 12:])


@pytest.mark.parametrize("factor", [0.25, 0.5])
def test_proportional_matches_transformers(factor):
    """Gemma 4's global layers: the first `factor` of the angles turn, over the whole head's
    exponents, the others stand still (frequency 0)."""
    from transformers import Gemma4TextConfig

    params = {"rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": 1e6}
    config = Gemma4TextConfig(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        head_dim=16,
        global_head_dim=64,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": params,
        },
    )
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    got, attention_factor = compute_rope(64, 1e6, params, 128)
    assert torch.equal(got, want) and attention_factor == 1.0
    assert (got[: int(32 * factor)] > 0).all() and (got[int(32 * factor) :] == 0).all()
