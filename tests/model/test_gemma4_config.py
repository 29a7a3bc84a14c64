"""Gemma 4's config.json read into ModelArch (loader/gemma4_config.py): the shapes of the
text config class's defaults (transformers' Gemma4TextConfig), a sparse image-and-text file
naming the global layers by global_head_dim and num_global_key_value_heads, the pool a block of
it takes, and the settings not supported named in their errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenbus.core.kv.hybrid import plan_kv_groups
from tokenbus.loader.hf_loader import arch_from_hf_config
from tokenbus.worker.kv_cache import bytes_per_block

PATH = Path("config.json")


def _class_defaults(**overrides) -> dict:
    """Gemma4TextConfig's defaults as transformers writes them (per_layer_config included)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**overrides).to_dict()


def test_the_text_config_class_s_defaults():
    """30 layers, five local (heads of 256, window 512) to one global (heads of 512), the
    global layers' proportional rope, per-layer inputs of 256."""
    arch = arch_from_hf_config(_class_defaults(), PATH)
    globals_ = {i for i in range(30) if i % 6 == 5}
    assert arch.architecture == "gemma4" and arch.num_hidden_layers == 30
    assert arch.sliding_windows == tuple(None if i in globals_ else 512 for i in range(30))
    assert arch.layer_kv_shapes == tuple((4, 512) if i in globals_ else (4, 256) for i in range(30))
    assert (arch.head_dim, arch.global_head_dim, arch.attn_k_eq_v) == (256, 512, False)
    assert arch.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (arch.rope_theta, arch.rope_local_theta) == (1e6, 1e4)
    assert (arch.per_layer_input_size, arch.per_layer_vocab_size) == (256, 262144)
    assert arch.kv_shared_layers == () and arch.tie_word_embeddings


def test_a_sparse_image_and_text_config_with_shared_kv():
    """The global layers' shape from global_head_dim and (keys as values)
    num_global_key_value_heads; the last ten layers read layers 18's (local) and 19's (global)
    K/V (Gemma 3n's rule) with double-wide MLPs."""
    text = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 30,
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 10,
        "use_double_wide_mlp": True,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 6,
        "final_logit_softcapping": 30.0,
    }
    config = {"model_type": "gemma4", "text_config": text, "vision_config": {}}
    arch = arch_from_hf_config(config, PATH)
    globals_ = {i for i in range(30) if i % 5 == 4}
    assert arch.layer_kv_shapes == tuple((1, 512) if i in globals_ else (2, 256) for i in range(30))
    assert arch.attn_k_eq_v and arch.num_kv_layers == 20
    assert dict(arch.kv_shared_layers) == {i: 19 if i in globals_ else 18 for i in range(20, 30)}
    assert arch.layer_intermediate_sizes == (6144,) * 20 + (12288,) * 10
    # under the hybrid cache the local layers' 16 and the global ones' 4 form groups of 4:
    # four local groups share 4 buffers of 2 x 256 rows, the global group 4 of 1 x 512 rows
    shapes = [arch.kv_shape(i) for i in range(30)]
    groups = plan_kv_groups(arch.sliding_windows, True, arch.kv_shared_layers, shapes)
    assert len(groups.groups) == 5 and groups.num_buffers == 8
    page = 2 * 16 * 2  # K and V, 16 tokens, bf16
    assert bytes_per_block(arch, 16, torch.bfloat16, groups) == page * (4 * 512 + 4 * 512)
    assert bytes_per_block(arch, 16, torch.bfloat16) == page * (16 * 512 + 4 * 512)


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(enable_moe_block=True, num_experts=8, top_k_experts=2), "moe_intermediate_size"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(hidden_activation="silu"), "hidden_activation"),
    ],
)
def test_settings_not_supported_are_named(edit, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(_class_defaults(**edit), PATH)


def test_experts_beside_the_mlp():
    """enable_moe_block: num_experts, top_k_experts and moe_intermediate_size."""
    config = _class_defaults(
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704
    )
    arch = arch_from_hf_config(config, PATH)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (128, 8, 704)
    assert arch.intermediate_size == 9216  # the dense MLP beside them keeps its width


def test_a_global_rope_type_not_supported_is_named():
    config = _class_defaults()
    config["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="full_attention: rope type 'yarn'"):
        arch_from_hf_config(config, PATH)


def test_the_last_layer_is_global_whatever_layer_types_says():
    """As Gemma4TextConfig forces it (35 layers of the default pattern end on a local one)."""
    arch = arch_from_hf_config(_class_defaults(num_hidden_layers=35), PATH)
    assert arch.sliding_windows[-1] is None and arch.sliding_windows[-2] == 512
    config = _class_defaults(num_hidden_layers=6)
    config["layer_types"] = ["sliding_attention"] * 6
    assert arch_from_hf_config(config, PATH).sliding_windows == (512,) * 5 + (None,)


def test_a_gguf_without_its_window_is_refused():
    from tokenbus.loader.gemma4_config import gemma4_gguf_fields

    meta = {"gemma4.block_count": 6, "gemma4.attention.head_count": 4}
    with pytest.raises(ValueError, match="gemma4.attention.sliding_window"):
        gemma4_gguf_fields(meta, {}, PATH)
