"""HF checkpoint directories: config.json -> ModelArch; *.safetensors (sharded or not) ->
weights."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from tokenbus.loader.cohere2_config import COHERE2_PATTERN
from tokenbus.loader.deepseek_config import DEEPSEEK_ARCHITECTURES, deepseek_hf_fields
from tokenbus.loader.ernie_config import ERNIE_ARCHITECTURES, check_ernie, ernie_hf_moe_fields
from tokenbus.loader.gemma3n_config import gemma3n_hf_fields
from tokenbus.loader.gemma4_config import gemma4_hf_fields
from tokenbus.loader.gemma_config import (
    GEMMA_ARCHITECTURES,
    gemma3_hf_rope,
    gemma_hf_fields,
)
from tokenbus.loader.glm4_moe_config import glm4_moe_hf_fields
from tokenbus.loader.gpt_oss_config import GPT_OSS_PATTERN, gpt_oss_hf_fields
from tokenbus.loader.granite_hybrid_config import granite_hybrid_hf_fields
from tokenbus.loader.hunyuan_config import hunyuan_rope
from tokenbus.loader.layer_kinds import (
    EXAONE4_PATTERN,
    OLMO3_PATTERN,
    OLMO3_ROPE_THETA,
    OLMO3_WINDOW,
    global_nope_layers,
    hf_local_layers,
    rope_by_layer_type,
    windows,
)
from tokenbus.loader.lfm2_config import lfm2_hf_fields, lfm2_moe_hf_fields, lfm3_hf_fields
from tokenbus.loader.minicpm3_config import minicpm3_hf_fields
from tokenbus.loader.minimax_m2_config import minimax_m2_hf_fields, minimax_m2_partial_rotary
from tokenbus.loader.multimodal_config import text_config
from tokenbus.loader.nemotron_h_config import nemotron_h_hf_fields, nemotron_h_kinds
from tokenbus.loader.quant_config import check_quantization, is_mxfp4
from tokenbus.loader.qwen3_5_config import qwen3_5_hf_fields, qwen3_5_moe_hf_fields
from tokenbus.model_arch import ModelArch

if TYPE_CHECKING:  # torch is imported where tensors are made: the API server reads model
    import torch  # metadata through this module, and its start-up is shorter without torch

# HF `architectures` entry -> ModelArch.architecture (model_type); model/registry.py builds each.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",  # Ministral-8B-2410: Mistral with layer_types
    "Ministral3ForCausalLM": "ministral3",  # Ministral 3: Mistral, YaRN, a query temperature
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",  # Qwen3's layers, q/k normed after the rotary
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3nForCausalLM": "gemma3n",  # AltUp, per-layer inputs, LAuReL, shared K/V
    "Gemma4ForCausalLM": "gemma4",  # per-layer K/V shapes, per-layer inputs, shared K/V
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",  # Granite 4.0 (-H: Mamba2 layers too)
    "GptOssForCausalLM": "gpt_oss",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Glm4ForCausalLM": "glm4",
    "SeedOssForCausalLM": "seed_oss",  # Seed-OSS: Llama's layers, q/k/v biases
    "ArceeForCausalLM": "arcee",  # AFM-4.5B: Llama's layers, ReLU² MLPs without a gate
    "ApertusForCausalLM": "apertus",  # Qwen3's q/k norms, xIELU MLPs without a gate
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5: DeepSeek-V3's router, NeoX's rotary
    "SolarOpenForCausalLM": "solar_open",  # GLM-4.5's MoE under Llama's attention
    "Dots1ForCausalLM": "dots1",  # GLM-4.5's MoE under Qwen3's attention
    "MiniMaxM2ForCausalLM": "minimax_m2",  # OLMo 2's q/k norms, sigmoid-routed experts
    "DeepseekV2ForCausalLM": "deepseek_v2",  # latent attention, softmax-routed experts
    "DeepseekV3ForCausalLM": "deepseek_v3",  # V2's attention, GLM-4.5's router
    "Mistral4ForCausalLM": "mistral4",  # V3's layers, a softmax router, a query temperature
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",  # GLM-4.7-Flash: DeepSeek-V3's layers
    "MiniCPM3ForCausalLM": "minicpm3",  # latent attention, muP's scales
    "CohereForCausalLM": "cohere",  # Command R, Aya 23, Aya Expanse: Cohere2's block, global
    "Cohere2ForCausalLM": "cohere2",
    "Exaone4ForCausalLM": "exaone4",
    "Lfm2ForCausalLM": "lfm2",  # LFM2 / LFM2.5: short convolutions and attention
    "Lfm2MoeForCausalLM": "lfm2_moe",  # LFM2's layers with sigmoid-routed experts
    "PhimoeForCausalLM": "phimoe",  # Mixtral's layers, LayerNorms, sparsemixer routing
    "PhiMoEForCausalLM": "phimoe",  # Microsoft's checkpoints' spelling
    "Lfm3ForCausalLM": "lfm3",  # LFM2's convolutions, gated and sliding attention, sandwiches
    "NemotronHForCausalLM": "nemotron_h",  # Mamba2, attention and MLP blocks
    "Qwen3_5ForCausalLM": "qwen3_5",  # Gated DeltaNet and gated attention layers
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",  # Qwen3.5's layers with experts
    "Qwen3NextForCausalLM": "qwen3_next",  # Qwen3.5-MoE's layers, projections fused
}
# Families whose rotary turns adjacent pairs of each head's (rotary) dims, GPT-J's layout: their
# q/k rows are reordered at load, pairs to halves, so our rotary turns them (model_loader.py).
INTERLEAVED_ROTARY_ARCHITECTURES = (*ERNIE_ARCHITECTURES, "glm4", "cohere", "cohere2")

# GLM-4's norms by the names of Gemma 2's sandwich block (decoder.SandwichDecoderLayer), which
# a GGUF of it uses too: after attention, before the MLP, after the MLP.
GLM4_NORM_NAMES = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
# model_type -> ModelArch.architecture where they differ (Gemma 3's text model).
HF_MODEL_TYPES = {
    "gemma3_text": "gemma3",
    "gemma3n_text": "gemma3n",
    "gemma4_text": "gemma4",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    # the Qwen-VL text models: Qwen2's and Qwen3's layers, whose multimodal rotary (MRoPE) turns
    # a text token by its position alone, as theirs does
    "qwen2_vl_text": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen3_vl_text": "qwen3",
}
# Rope types we pass on to the model (model/layers/rotary.py ROPE_TYPES; a test keeps them in sync).
HF_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}
# Families whose HF model turns only the first partial_rotary_factor of each head (Phi-4-mini,
# GLM-4, GLM-4.5, Qwen3.5, MiniMax-M2).
PARTIAL_ROTARY_ARCHITECTURES = (
    *("phi3", "glm4", "glm4_moe", "minimax_m2"),
    *("qwen3_5", "qwen3_5_moe", "qwen3_next"),
)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def arch_from_hf_config(config: dict[str, Any], path: Path) -> ModelArch:
    """Resolve a config.json (transformers 4.x or 5.x layout) into a ModelArch; an
    image-and-text checkpoint's from its text_config."""
    config = text_config(config, path)
    architecture = _architecture(config, path)
    if architecture == "seed_oss":  # SeedOssConfig's defaults where the file names none
        config = {"head_dim": 128, "attention_bias": True, **config}
        if config.get("attention_out_bias"):
            raise ValueError(f"{path}: attention_out_bias=true is not supported for seed_oss")
    if architecture == "arcee":  # ArceeConfig's default
        config = {"hidden_act": "relu2", **config}
    if architecture == "apertus":  # ApertusConfig's default
        config = {"hidden_act": "xielu", **config}
    if architecture == "lfm3":  # Lfm3Config's defaults where the file names none
        config = {"head_dim": 128, "num_key_value_heads": 4, **config}
    if architecture == "nemotron_h":  # its layer count is its block list's (transformers')
        config = {**config, "num_hidden_layers": len(nemotron_h_kinds(config, path))}

    def need(key: str) -> Any:
        if config.get(key) is None:
            raise ValueError(f"{path}: missing {key!r}")
        return config[key]

    if config.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias=true is not supported")
    check_quantization(config, architecture, path)
    hidden_size, num_heads = need("hidden_size"), need("num_attention_heads")
    if architecture in ERNIE_ARCHITECTURES:
        check_ernie(config, path)
    family: dict[str, Any] = {}
    if architecture in GEMMA_ARCHITECTURES:
        family = gemma_hf_fields(config, path, architecture)
    rope_config, local_theta = config, None
    if architecture == "gemma3":  # the global layers' rope; the local ones' base apart
        rope_config, family["rope_local_theta"] = gemma3_hf_rope(config, path)
    if architecture == "gemma3n":  # the global layers' rope; the local ones' base in family
        family, rope_config = gemma3n_hf_fields(config, path)
    if architecture == "gemma4":  # both kinds' rope and head sizes in family
        family = gemma4_hf_fields(config, path)
        rope_config = {"rope_theta": family["rope_theta"]}
    if architecture == "olmo3":
        rope_config, local_theta = _olmo3_rope(config, path)
    if architecture == "hunyuan_v1_dense":  # its NTK alpha: a fixed, stretched base
        rope_config = hunyuan_rope(config, path)
    if architecture == "gpt_oss":
        family = gpt_oss_hf_fields(config)
    if architecture in ("ministral3", "mistral4"):
        rope_config, family["attn_temperature"] = _llama4_temperature(config, path, architecture)
    if architecture == "lfm2":
        family = lfm2_hf_fields(config, path)
    if architecture == "lfm2_moe":
        family = lfm2_moe_hf_fields(config, path)
    if architecture == "phimoe":
        family = {"lm_head_bias": bool(config.get("lm_head_bias", False))}
    if architecture == "lfm3":  # both kinds' rope in family
        family = lfm3_hf_fields(config, path)
        rope_config = {"rope_theta": family["rope_theta"]}
    if architecture == "glm4_moe":  # half of each head turns unless the config says otherwise
        rope_config = {"partial_rotary_factor": 0.5, **config}
        family = glm4_moe_hf_fields(config, path)
    if architecture in ("solar_open", "dots1"):
        family = glm4_moe_hf_fields(config, path, architecture)
    if architecture == "minimax_m2":
        rope_config = minimax_m2_partial_rotary(config)
        family = minimax_m2_hf_fields(config, path)
    if architecture in DEEPSEEK_ARCHITECTURES:  # Mistral 4's temperature kept
        family.update(deepseek_hf_fields(config, path, architecture))
    if architecture == "minicpm3":
        family = minicpm3_hf_fields(config, path)
    if architecture == "granitemoehybrid":  # its Mamba2 layers, where it has some
        family = granite_hybrid_hf_fields(config, path)
    if architecture == "nemotron_h":
        family = nemotron_h_hf_fields(config, path)
    if architecture in ("qwen3_5", "qwen3_next"):  # Qwen3-Next's experts: _moe_fields
        family = qwen3_5_hf_fields(config, path)
    if architecture == "qwen3_5_moe":
        family = qwen3_5_moe_hf_fields(config, path)
    head_dim = config.get("head_dim") or hidden_size // num_heads
    rope_theta, rope_scaling, partial_rotary_factor = _rope(rope_config, path, architecture)
    if architecture == "phimoe" and rope_scaling is not None:
        rope_scaling = _phimoe_longrope(rope_scaling, path)
    rotary_dim = None if partial_rotary_factor == 1.0 else int(head_dim * partial_rotary_factor)
    nope_layers = _nope_layers(config, architecture, path)
    sliding_windows = _sliding_windows(config, architecture, path, nope_layers)
    own_table = rope_scaling is not None or local_theta != rope_theta
    if local_theta is not None and sliding_windows and own_table:
        family["rope_local_theta"] = local_theta  # OLMo 3's local layers: its base, unscaled
    eos = config.get("eos_token_id")
    arch = ModelArch(
        architecture=architecture,
        vocab_size=need("vocab_size"),
        hidden_size=hidden_size,
        # a family's own width where it says one (Granite 4.0's shared MLP, LFM2's adjusted
        # one, Qwen3.5-MoE's shared expert: it has no dense MLP)
        intermediate_size=int(family.get("intermediate_size") or need("intermediate_size")),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        # Cohere's LayerNorm names it layer_norm_eps
        rms_norm_eps=float(config.get("rms_norm_eps", config.get("layer_norm_eps", 1e-6))),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # Gemma ties its head unless the config says otherwise (transformers' default there)
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", architecture in GEMMA_ARCHITECTURES)
        ),
        attention_bias=_attention_bias(config, architecture),
        hidden_act=config.get("hidden_act", "silu"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        rotary_dim=rotary_dim,
        sliding_windows=sliding_windows,
        nope_layers=nope_layers,
        **_granite_fields(config, architecture),
        **_moe_fields(config, architecture, path),
    )
    return dataclasses.replace(arch, **family) if family else arch


def hf_blocks_quantized(directory: Path) -> bool:
    """Whether an HF checkpoint holds blocks the quantized kernels run (gpt-oss's MXFP4)."""
    path = directory / "config.json"
    return path.is_file() and is_mxfp4(read_json(path))


def _attention_bias(config: dict[str, Any], architecture: str) -> bool:
    """Qwen2 always has q/k/v biases; Qwen2-MoE's `qkv_bias` says (True before the key
    existed); the others' `attention_bias`."""
    if architecture == "qwen2":
        return True
    if architecture == "qwen2_moe":
        return bool(config.get("qkv_bias", True))
    return bool(config.get("attention_bias", False))


def _moe_fields(config: dict[str, Any], architecture: str, path: Path) -> dict[str, Any]:
    """ModelArch's MoE fields (model/moe.py) of a Mixtral, PhiMoE, Qwen3-MoE, Qwen2-MoE, OLMoE,
    GraniteMoE, gpt-oss or Qwen3-Next config; {} otherwise. Fields we do not implement (shared
    experts outside Qwen2-MoE, OLMoE's clip_qkv) are refused, naming them. ERNIE 4.5's:
    ernie_config.py."""
    if architecture == "ernie4_5_moe":
        return ernie_hf_moe_fields(config, path)
    moe = ("mixtral", "phimoe", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gpt_oss")
    moe += ("qwen3_next",)
    if architecture not in moe:
        return {}
    if config.get("clip_qkv") is not None:
        raise ValueError(f"{path}: clip_qkv is not supported for {architecture}")
    shared_keys = ("n_shared_experts",)
    if architecture not in ("qwen2_moe", "qwen3_next"):
        shared_keys += ("shared_expert_intermediate_size",)
    for key in shared_keys:
        if config.get(key):
            raise ValueError(f"{path}: {key} (shared experts) is not supported for {architecture}")
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    top_k = config.get("num_experts_per_tok")
    if not num_experts or not top_k:
        raise ValueError(
            f"{path}: an MoE config needs 'num_local_experts' and 'num_experts_per_tok'"
        )
    num_layers = int(config["num_hidden_layers"])
    if architecture == "phimoe":  # two experts chosen one by one, weights as they come
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=config["intermediate_size"],
            norm_topk_prob=False,
            moe_scoring="sparsemixer",
            moe_jitter_eps=float(config.get("router_jitter_noise") or 0.01),
        )
    if architecture in ("mixtral", "granitemoe", "gpt_oss"):  # softmax over the top k logits
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=config["intermediate_size"],
            norm_topk_prob=True,
        )
    step = int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or ())
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(num_layers) if i in only or (i + 1) % step),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
    )


def _architecture(config: dict[str, Any], path: Path) -> str:
    model_type = config.get("model_type")
    if model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    if model_type in HF_ARCHITECTURES.values():
        return model_type
    for name in config.get("architectures") or ():
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    found = model_type or config.get("architectures")
    raise ValueError(
        f"{path}: unsupported model architecture {found!r} "
        f"(supported: {', '.join(HF_ARCHITECTURES)})"
    )


def _rope(
    config: dict[str, Any], path: Path, architecture: str
) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from 5.x `rope_parameters` or
    4.x `rope_theta`/`rope_scaling`/`partial_rotary_factor`, with the defaults transformers fills
    in (standardize_rope_params) written out, so the model needs no other config field."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor")
    partial = float(partial or 1.0)
    if partial != 1.0 and architecture not in PARTIAL_ROTARY_ARCHITECTURES:
        raise ValueError(
            f"{path}: partial_rotary_factor={partial} is not supported for {architecture} "
            f"(only {', '.join(PARTIAL_ROTARY_ARCHITECTURES)})"
        )
    legacy_type = params.pop("type", None)  # transformers 4.x's name of the field
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "su" or (architecture == "phi3" and rope_type == "yarn"):
        rope_type = "longrope"  # as transformers' Phi3Config reads these older names
    if rope_type not in HF_ROPE_TYPES:
        raise ValueError(
            f"{path}: unsupported rope type {rope_type!r} (supported: {', '.join(HF_ROPE_TYPES)})"
        )
    missing = [key for key in _ROPE_REQUIRED_KEYS.get(rope_type, ()) if key not in params]
    if missing:
        raise ValueError(f"{path}: rope type {rope_type!r} needs {missing}")
    if rope_type in ("yarn", "longrope"):
        params.update(_extended_context(config, params, architecture))
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}, partial


def _phimoe_longrope(scaling: dict[str, Any], path: Path) -> dict[str, Any]:
    """PhiMoE's LongRoPE as HF's PhimoeRotaryEmbedding computes it: the short factors at every
    length (its long ones unused), cos and sin scaled by short_mscale. HF scales by long_mscale
    instead for a forward whose positions pass the original context, which an engine holding
    K/V cannot switch to in the middle of a sequence: past it, tokenbus keeps short_mscale."""
    if scaling.get("rope_type") != "longrope":
        raise ValueError(
            f"{path}: rope type {scaling.get('rope_type')!r} is not supported for phimoe"
        )
    if "short_mscale" not in scaling:
        raise ValueError(f"{path}: a phimoe LongRoPE needs 'short_mscale'")
    short = scaling["short_factor"]
    return {**scaling, "long_factor": short, "attention_factor": float(scaling["short_mscale"])}


def _extended_context(
    config: dict[str, Any], params: dict[str, Any], architecture: str
) -> dict[str, Any]:
    """YaRN's and LongRoPE's pretraining context and scale factor, as transformers resolves
    them (standardize_rope_params): `original_max_position_embeddings` beside rope_scaling wins
    (Phi-3 keeps it there; its config class defaults it to 4096), else the one inside it, else
    max_position_embeddings; a missing `factor` is max_position_embeddings / original (it sets
    LongRoPE's attention factor)."""
    max_positions = int(config.get("max_position_embeddings", 2048))
    original = config.get("original_max_position_embeddings")
    if original is None:
        inside = params.get("original_max_position_embeddings")
        original = 4096 if architecture == "phi3" else (inside or max_positions)
    factor = params.get("factor")
    return {
        "original_max_position_embeddings": int(original),
        "factor": float(factor) if factor is not None else max_positions / original,
    }


def _olmo3_rope(config: dict[str, Any], path: Path) -> tuple[dict[str, Any], float]:
    """(a flat rope config for OLMo 3's global layers, its local layers' base): its
    rope_scaling (YaRN in the long-context models) is the global layers' only, the local ones
    take the default rope on the same rope_theta (Olmo3Config's; default 500k)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5
        flat, theta = rope_by_layer_type(params, path)
        full_theta = (params["full_attention"] or {}).get("rope_theta", OLMO3_ROPE_THETA)
        return flat, float(theta if theta is not None else full_theta)
    theta = float(config.get("rope_theta", OLMO3_ROPE_THETA))
    return {**config, "rope_theta": theta}, theta


def _llama4_temperature(
    config: dict[str, Any], path: Path, architecture: str
) -> tuple[dict[str, Any], tuple[float, int] | None]:
    """Ministral 3's and Mistral 4's rope_parameters without their `llama_4_scaling_beta` (and
    the copy of max_position_embeddings kept there; Mistral 4's latent attention turns its
    qk_rope_head_dim, which its partial_rotary_factor restates), and that query temperature:
    (beta, the YaRN's original context), as their attention reads them; None without a beta."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    beta = params.pop("llama_4_scaling_beta", None)
    params.pop("max_position_embeddings", None)
    if architecture == "mistral4":
        params.pop("partial_rotary_factor", None)
    rope_config = {**config, "rope_parameters": params, "rope_scaling": None}
    if not beta:
        return rope_config, None
    length = params.get("original_max_position_embeddings")
    if not length:
        raise ValueError(f"{path}: llama_4_scaling_beta needs original_max_position_embeddings")
    return rope_config, (float(beta), int(length))


def _granite_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Granite's four multipliers (GraniteConfig's defaults: 1), Cohere's and Cohere2's
    logit_scale (as the divisor's inverse) and Command R+'s per-head q/k LayerNorms
    (`use_qk_norm`); {} for the other families."""
    if architecture in ("cohere", "cohere2"):
        scaling = 1.0 / float(config.get("logit_scale", 0.0625))
        return dict(logits_scaling=scaling, attn_qk_norm=bool(config.get("use_qk_norm", False)))
    if architecture not in ("granite", "granitemoe", "granitemoehybrid"):
        return {}
    return dict(
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        attention_multiplier=float(config.get("attention_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)),
    )


def _nope_layers(config: dict[str, Any], architecture: str, path: Path) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: where `no_rope_layers` says 0, or (absent) every
    `no_rope_layer_interval`-th layer (default 4: layers 3, 7, ...), as SmolLM3Config fills it.
    Granite 4.0's: all of them unless `position_embedding_type` is "rope" (its model's test).
    Cohere2's and (with windows) EXAONE 4's: their global layers."""
    num_layers = int(config["num_hidden_layers"])
    if architecture == "cohere2":  # its global layers turn no rotary (Cohere2Attention)
        return global_nope_layers(hf_local_layers(config, path, num_layers, COHERE2_PATTERN))
    if architecture == "exaone4":  # likewise where it has windows (Exaone4Attention)
        if not config.get("sliding_window"):
            return ()
        return global_nope_layers(hf_local_layers(config, path, num_layers, EXAONE4_PATTERN))
    if architecture == "granitemoehybrid":
        rope = config.get("position_embedding_type") == "rope"
        return () if rope else tuple(range(num_layers))
    if architecture != "smollm3":
        return ()
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or 4)
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if len(flags) != num_layers or set(flags) - {0, 1}:
        raise ValueError(
            f"{path}: no_rope_layers must hold 1 (rotary) or 0 (none) for each of the "
            f"{num_layers} layers, got {flags!r}"
        )
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _sliding_windows(
    config: dict[str, Any], architecture: str, path: Path, nope_layers: tuple[int, ...] = ()
) -> tuple[int | None, ...]:
    """Each layer's window as transformers builds them: Mistral's, Mixtral's, Phi-3's and
    PhiMoE's `sliding_window` on every layer, Qwen3-MoE's too with `use_sliding_window`; Qwen2's /
    Qwen2-MoE's / Qwen3's / SmolLM3's only with `use_sliding_window`, on the layers of
    `layer_types` (or, in a
    config without them, from `max_window_layers` on; SmolLM3: its `nope_layers`); OLMo 3's on
    the layers of `layer_types` (default: all but every fourth); Ministral's on those of
    `layer_types` (default: all); () where no layer has one."""
    window = config.get("sliding_window")
    if architecture == "olmo3":
        window = config.get("sliding_window", OLMO3_WINDOW)
    gated = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")  # only with use_sliding_window
    if architecture in gated and not config.get("use_sliding_window"):
        window = None
    windowed = (
        *("mistral", "ministral", "ministral3", "mixtral", "phi3", "phimoe", "olmo3", "gpt_oss"),
        *("cohere2", "exaone4", "dots1"),
        *gated,
    )
    if architecture not in windowed or not window:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    num_layers = config.get("num_hidden_layers", 0)
    every_layer = architecture in (
        "mistral",
        "ministral3",
        "mixtral",
        "phi3",
        "phimoe",
        "qwen3_moe",
    )
    if every_layer or (architecture == "ministral" and not config.get("layer_types")):
        return (window,) * num_layers
    patterned = ("olmo3", "gpt_oss", "cohere2", "exaone4")
    if config.get("layer_types") is not None or architecture in patterned:
        # layer_types (the pattern stands in for absent ones: OLMo 3's and Cohere2's every
        # fourth global, gpt-oss's every second)
        pattern = GPT_OSS_PATTERN if architecture == "gpt_oss" else OLMO3_PATTERN
        local = hf_local_layers(config, path, num_layers, pattern)
    elif architecture == "smollm3":
        local = [i in nope_layers for i in range(num_layers)]
    else:
        first = config.get("max_window_layers", num_layers)
        local = [i >= first for i in range(num_layers)]
    return windows(local, window)


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index}: shard {file.name} not found in {directory}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weights found")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each file; a damaged file raises ValueError naming it."""
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{file}: cannot read safetensors weights (truncated or corrupted?): {e}"
            ) from e
