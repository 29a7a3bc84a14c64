"""The config.json files of released checkpoints (their fields as published, in the layout of the
transformers version that wrote them) resolve to the shapes the models have: the families whose
tiny test models transformers 5 writes in its own layout (tests/e2e/) read the older files too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenbus.loader.fp8 import Fp8Scheme, fp8_scheme
from tokenbus.loader.hf_loader import arch_from_hf_config

PATH = Path("config.json")

GLM_4_5_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": False,
    "vocab_size": 151552,
}
# GLM-4.5 (355B-A32B): wider, q/k norms, three dense layers, weights x2.5
GLM_4_5 = {
    **GLM_4_5_AIR,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "routed_scaling_factor": 2.5,
    "use_qk_norm": True,
}
# Solar Open (102B-A12B): GLM-4.5's MoE in every layer under Llama's attention; no dense width
SOLAR_OPEN = {
    "architectures": ["SolarOpenForCausalLM"],
    "model_type": "solar_open",
    "head_dim": 128,
    "hidden_size": 4096,
    "moe_intermediate_size": 1280,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "rope_theta": 1000000.0,
    "vocab_size": 196608,
}
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}
SEED_OSS_36B = {
    "architectures": ["SeedOssForCausalLM"],
    "model_type": "seed_oss",
    "attention_bias": True,
    "attention_out_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "max_position_embeddings": 524288,
    "mlp_bias": False,
    "num_attention_heads": 80,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"rope_type": "default"},
    "rope_theta": 10000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 155136,
}
COMMAND_R = {
    "architectures": ["CohereForCausalLM"],
    "model_type": "cohere",
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 22528,
    "layer_norm_eps": 1e-05,
    "logit_scale": 0.0625,
    "max_position_embeddings": 8192,
    "num_attention_heads": 64,
    "num_hidden_layers": 40,
    "num_key_value_heads": 64,
    "rope_theta": 8000000.0,
    "tie_word_embeddings": True,
    "use_qk_norm": False,
    "vocab_size": 256000,
}
AFM_4_5B = {
    "architectures": ["ArceeForCausalLM"],
    "model_type": "arcee",
    "head_dim": 128,
    "hidden_act": "relu2",
    "hidden_size": 2560,
    "intermediate_size": 18432,
    "max_position_embeddings": 65536,
    "num_attention_heads": 20,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 4096},
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128004,
}


@pytest.mark.parametrize(
    "config, dense, shared, scale, qk_norm",
    [(GLM_4_5_AIR, (0,), 1408, 1.0, False), (GLM_4_5, (0, 1, 2), 1536, 2.5, True)],
)
def test_glm_4_5(config, dense, shared, scale, qk_norm):
    arch = arch_from_hf_config(config, PATH)
    assert (arch.architecture, arch.head_dim, arch.rotary_dim) == ("glm4_moe", 128, 64)
    assert (arch.num_hidden_layers, arch.dense_layers) == (config["num_hidden_layers"], dense)
    assert (arch.num_experts, arch.num_experts_per_tok) == (config["n_routed_experts"], 8)
    assert (arch.shared_expert_intermediate_size, arch.shared_expert_gated) == (shared, False)
    routing = (arch.moe_scoring, arch.moe_norm_eps, arch.routed_scaling_factor, arch.moe_groups)
    assert routing == ("sigmoid", 1e-20, scale, 1)
    assert arch.attention_bias and arch.attn_qk_norm == qk_norm
    assert arch.eos_token_ids == (151329, 151336, 151338) and arch.rope_theta == 1e6


def test_minimax_m2():
    arch = arch_from_hf_config(MINIMAX_M2, PATH)
    assert (arch.architecture, arch.head_dim, arch.rotary_dim, arch.rope_theta) == (
        "minimax_m2",
        128,
        64,
        5e6,
    )
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
        256,
        8,
        1536,
    )
    assert (arch.moe_scoring, arch.moe_selection_bias, arch.dense_layers) == ("sigmoid", True, ())
    assert arch.sliding_windows == ()
    # the released safetensors hold FP8 blocks: read as their fp32 values (loader/fp8.py)
    fp8 = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128]}
    assert arch_from_hf_config({**MINIMAX_M2, "quantization_config": fp8}, PATH) == arch
    assert fp8_scheme({"quantization_config": fp8}, PATH) == Fp8Scheme((128, 128))


def test_seed_oss_36b():
    arch = arch_from_hf_config(SEED_OSS_36B, PATH)
    assert (arch.architecture, arch.head_dim, arch.num_key_value_heads) == ("seed_oss", 128, 8)
    assert arch.attention_bias and arch.rope_scaling is None and arch.rope_theta == 1e7


def test_command_r():
    arch = arch_from_hf_config(COMMAND_R, PATH)
    assert (arch.architecture, arch.head_dim, arch.rms_norm_eps) == ("cohere", 128, 1e-05)
    assert arch.logits_scaling == 16.0 and arch.tie_word_embeddings
    assert (arch.sliding_windows, arch.nope_layers, arch.rotary_dim) == ((), (), None)


def test_afm_4_5b():
    arch = arch_from_hf_config(AFM_4_5B, PATH)
    assert (arch.architecture, arch.hidden_act, arch.head_dim) == ("arcee", "relu2", 128)
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["factor"] == 20.0


def test_solar_open():
    arch = arch_from_hf_config(SOLAR_OPEN, PATH)
    assert (arch.architecture, arch.dense_layers, arch.rotary_dim) == ("solar_open", (), None)
    assert (arch.intermediate_size, arch.shared_expert_intermediate_size) == (1280, 1280)
    assert (arch.num_experts, arch.moe_scoring, arch.attn_qk_norm) == (128, "sigmoid", False)


DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "vocab_size": 102400,
}
# DeepSeek-V3 (671B-A37B) as a bf16 conversion (the released files hold FP8 blocks: refused)
DEEPSEEK_V3 = {
    **DEEPSEEK_V2_LITE,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "rope_scaling": {**DEEPSEEK_V2_LITE["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0},
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "vocab_size": 129280,
}


def test_deepseek_v2_lite():
    """Latent attention without a query bottleneck, YaRN x40 whose mscale_all_dim scales the
    softmax; 64 experts by softmax, 6 a token, not renormalised, a shared MLP two wide."""
    from tokenbus.model.mla import softmax_scale

    arch = arch_from_hf_config(DEEPSEEK_V2_LITE, PATH)
    assert (arch.architecture, arch.num_key_value_heads, arch.head_dim) == ("deepseek_v2", 1, 576)
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.rotary_dim) == (0, 512, 64)
    assert (arch.qk_nope_head_dim, arch.v_head_dim, arch.mla_rope_interleaved) == (128, 128, True)
    assert arch.kv_bytes_per_token == 2 * 27 * 576  # one latent a token and layer (K and V)
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert softmax_scale(arch) == pytest.approx(192**-0.5 * mscale**2)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.dense_layers) == (64, 6, (0,))
    assert (arch.moe_scoring, arch.norm_topk_prob, arch.shared_expert_intermediate_size) == (
        "softmax",
        False,
        2816,
    )


def test_deepseek_v3():
    arch = arch_from_hf_config(DEEPSEEK_V3, PATH)
    assert (arch.architecture, arch.q_lora_rank, arch.head_dim) == ("deepseek_v3", 1536, 576)
    assert (arch.num_hidden_layers, arch.dense_layers) == (61, (0, 1, 2))
    routing = (arch.moe_scoring, arch.moe_selection_bias, arch.moe_groups, arch.moe_topk_groups)
    assert routing == ("sigmoid", True, 8, 4)
    assert (arch.norm_topk_prob, arch.routed_scaling_factor) == (True, 2.5)
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert arch_from_hf_config({**DEEPSEEK_V3, "quantization_config": fp8}, PATH) == arch


# MiniCPM3-4B (MiniCPM3Config's defaults are its values)
MINICPM3_4B = {
    "architectures": ["MiniCPM3ForCausalLM"],
    "model_type": "minicpm3",
    "hidden_size": 2560,
    "intermediate_size": 6400,
    "num_hidden_layers": 62,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "vocab_size": 73448,
    "kv_lora_rank": 256,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "scale_emb": 12,
    "scale_depth": 1.4,
    "dim_model_base": 256,
}


def test_minicpm3_4b():
    """Latent attention (a cache of 256 + 32 a token and layer) with values of hidden / heads,
    the rotary in halves; muP's scales as Granite's multipliers."""
    arch = arch_from_hf_config(MINICPM3_4B, PATH)
    assert (arch.architecture, arch.num_key_value_heads, arch.head_dim) == ("minicpm3", 1, 288)
    assert (arch.q_lora_rank, arch.qk_nope_head_dim, arch.v_head_dim) == (768, 64, 64)
    assert (arch.rotary_dim, arch.mla_rope_interleaved) == (32, False)
    assert (arch.embedding_multiplier, arch.logits_scaling) == (12.0, 10.0)
    assert arch.residual_multiplier == pytest.approx(1.4 / math.sqrt(62))


def _gemma3n(layers: int, width: int, shared: int) -> dict:
    """Gemma 3n's released file (transformers 4.53's layout): the text model's config under
    Gemma3nForConditionalGeneration, beside its vision and audio towers'."""
    text = {
        "model_type": "gemma3n_text",
        "activation_sparsity_pattern": [0.95] * 10 + [0.0] * (layers - 10),
        "altup_active_idx": 0,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_num_inputs": 4,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2048,
        "hidden_size_per_layer_input": 256,
        "intermediate_size": [width] * layers,
        "laurel_rank": 64,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "max_position_embeddings": 32768,
        "num_attention_heads": 8,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": shared,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 512,
        "vocab_size": 262400,
        "vocab_size_per_layer_input": 262144,
    }
    text["layer_types"] = text["layer_types"] * (layers // 5)
    return {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "text_config": text,
        "vision_config": {"model_type": "gemma3n_vision"},
        "audio_config": {"model_type": "gemma3n_audio"},
    }


@pytest.mark.parametrize(
    "layers, width, shared", [(30, 8192, 10), (35, 16384, 15)], ids=["E2B", "E4B"]
)
def test_gemma3n(layers, width, shared):
    """Gemma 3n E2B and E4B: twenty layers hold K/V (as llama.cpp's n_layer_kv_from_start),
    the rest read layer 18's (local) and 19's (global); the first ten MLPs sparse at 0.95."""
    arch = arch_from_hf_config(_gemma3n(layers, width, shared), PATH)
    assert (arch.architecture, arch.intermediate_size, arch.num_kv_layers) == ("gemma3n", width, 20)
    globals_ = {i for i in range(layers) if i % 5 == 4}
    assert dict(arch.kv_shared_layers) == {
        i: 19 if i in globals_ else 18 for i in range(20, layers)
    }
    assert arch.sliding_windows == tuple(None if i in globals_ else 512 for i in range(layers))
    assert (arch.rope_theta, arch.rope_local_theta, arch.final_logit_softcapping) == (
        1e6,
        1e4,
        30.0,
    )
    assert (arch.per_layer_input_size, arch.per_layer_vocab_size, arch.laurel_rank) == (
        256,
        262144,
        64,
    )
    assert arch.activation_sparsity_std == (pytest.approx(1.6448536),) * 10 + (None,) * (
        layers - 10
    )
    assert arch.tie_word_embeddings and arch.vocab_size == 262400


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(intermediate_size=[8192] * 15 + [4096] * 15), "an MLP width per layer"),
        (dict(altup_active_idx=1), "altup_active_idx must be 0"),
        (dict(activation_sparsity_pattern=[0.95] * 3), "activation_sparsity_pattern"),
        (dict(num_kv_shared_layers=29), "no earlier global layer"),
    ],
)
def test_gemma3n_shapes_not_supported_are_named(edit, message):
    config = _gemma3n(30, 8192, 10)
    config["text_config"].update(edit)
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config, PATH)


def test_mistral_small_4():
    """Mistral Small 4 (119B-2603): Mistral3ForConditionalGeneration around a mistral4 text
    model whose config class's defaults are the released values: DeepSeek-V3's latent attention
    (a cache of 256 + 64 a token and layer), 128 experts of 2048 (4 a token, by softmax) and a
    shared one, YaRN x128 over 8192, and Llama 4's query temperature (beta 0.1 over 8192)."""
    config = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "text_config": {"model_type": "mistral4"},
        "vision_config": {"model_type": "pixtral"},
    }
    arch = arch_from_hf_config(config, PATH)
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size) == ("mistral4", 36, 4096)
    assert (arch.num_key_value_heads, arch.head_dim, arch.rotary_dim) == (1, 320, 64)
    assert (arch.q_lora_rank, arch.qk_nope_head_dim, arch.v_head_dim) == (1024, 64, 128)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
        128,
        4,
        2048,
    )
    assert (arch.moe_scoring, arch.moe_selection_bias, arch.dense_layers) == ("softmax", False, ())
    assert arch.shared_expert_intermediate_size == 2048
    assert arch.attn_temperature == (0.1, 8192)
    assert (arch.rope_scaling["rope_type"], arch.rope_scaling["factor"]) == ("yarn", 128.0)


def test_hunyuan_7b():
    """Hunyuan-7B's kind in transformers 4's layout: its rope labelled "dynamic" with an NTK
    alpha of 1000 is a fixed base, 10000 * 1000 ** (128 / 126), unscaled from then on."""
    config = {
        "architectures": ["HunYuanDenseV1ForCausalLM"],
        "model_type": "hunyuan_v1_dense",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128167,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
        "rms_norm_eps": 1e-05,
    }
    arch = arch_from_hf_config(config, PATH)
    assert (arch.architecture, arch.head_dim, arch.rope_scaling) == ("hunyuan_v1_dense", 128, None)
    assert arch.rope_theta == pytest.approx(10000.0 * 1000.0 ** (128 / 126))
