"""DeepSeek-V2/V3 shapes (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM,
Mistral4ForCausalLM; L2, no torch): what their config.json and llama.cpp's `deepseek2` (and
`mistral4`) GGUF say beyond a Llama's. hf_loader / gguf_loader join these ModelArch fields to
the rest.

- Attention: multi-head latent attention (model/mla.py). The cache holds one KV head of
  kv_lora_rank + qk_rope_head_dim values a token (head_dim here; llama.cpp's key_length, with
  head_count_kv 1); each query head has qk_nope_head_dim + qk_rope_head_dim dims (llama.cpp's
  key_length_mla), each value head v_head_dim (value_length_mla). The rotary turns adjacent
  pairs (DeepSeek-V2's complex rotary, V3's `rope_interleave`, llama.cpp's NORM rope) unless
  a V3 config says `rope_interleave: false`.
- YaRN (DeepSeek-V2-Lite's, V3's): `mscale_all_dim` sets the softmax scale too (model/mla.py);
  llama.cpp writes 0.1 * mscale_all_dim as yarn_log_multiplier. With DeepSeek's equal mscale
  and mscale_all_dim, cos/sin are unscaled.
- MoE: dense MLPs in the first `first_k_dense_replace` layers (GLM-4.7-Flash: its
  `mlp_layer_types`), then `n_routed_experts` experts and an ungated shared MLP of
  `n_shared_experts` experts' width. DeepSeek-V2 routes by a softmax over the experts, the top
  k never renormalised (transformers drops `norm_topk_prob`), scaled by routed_scaling_factor;
  its `group_limited_greedy` (each group scored by its best expert) is refused. DeepSeek-V3 and
  GLM-4.7-Flash route as GLM-4.5 (loader/glm4_moe_config.py): sigmoid, bias, groups.
- Mistral Small 4 (`mistral4`): DeepSeek-V3's layers, routed by a softmax within the best
  groups (no bias), renormalised, and Llama 4's query temperature (hf_loader reads its
  `llama_4_scaling_beta`); llama.cpp writes it as `mistral4`, deepseek2's tensors and keys.
- Multi-token-prediction layers after the model's are not read (V3's layer 61,
  GLM-4.7-Flash's 47; a deepseek2 GGUF counts them in block_count where nextn_predict_layers
  says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

DEEPSEEK_GGUF = "deepseek2"
MISTRAL4_GGUF = "mistral4"  # deepseek2's tensors and keys under its own name
DEEPSEEK_GGUF_ARCHITECTURES = (DEEPSEEK_GGUF, MISTRAL4_GGUF)
DEEPSEEK_ARCHITECTURES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4")
# llama.cpp's deepseek2 tensor names (blk.N.<gguf>) as HF's under model.layers.N (attn_k_b and
# attn_v_b, its split of kv_b_proj, are joined back at load: joined_kv_b)
MLA_GGUF_BLOCK_NAMES = {  # the latent attention's (MiniCPM3's too)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
DEEPSEEK_GGUF_BLOCK_NAMES = {
    **MLA_GGUF_BLOCK_NAMES,
    "attn_k_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}
# The leading dense layers where a config names none (transformers' defaults)
_FIRST_DENSE = {"deepseek_v2": 0, "deepseek_v3": 3, "glm4_moe_lite": 1, "mistral4": 0}
# transformers' DeepseekV3TopkRouter keeps the renormalising sum off 0 by this much
_NORM_EPS = 1e-20
# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType)
_GGUF_SCORINGS = {1: "softmax", 2: "sigmoid"}
# llama.cpp's deepseek2 stores 0.1 * mscale_all_dim as yarn_log_multiplier
_GGUF_LOG_MULTIPLIER_SCALE = 0.1


def deepseek_hf_fields(config: dict[str, Any], path: Path, architecture: str) -> dict[str, Any]:
    """ModelArch fields of a DeepSeek-V2/V3 or GLM-4.7-Flash config beyond the shared ones."""
    need = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in (*need, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not config.get(key):
            raise ValueError(f"{path}: a {architecture} config needs {key!r}")
    num_layers = int(config["num_hidden_layers"])
    width = int(config["moe_intermediate_size"])
    v2 = architecture == "deepseek_v2"
    if v2 and config.get("topk_method", "greedy") != "greedy":
        raise ValueError(
            f"{path}: topk_method {config['topk_method']!r} is not supported for deepseek_v2 "
            "(only 'greedy')"
        )
    if "mlp_layer_types" in config:  # GLM-4.7-Flash's
        dense = tuple(i for i, kind in enumerate(config["mlp_layer_types"]) if kind == "dense")
    else:
        first = config.get("first_k_dense_replace", _FIRST_DENSE[architecture])
        dense = tuple(range(min(int(first), num_layers)))
    router = (
        dict(moe_scoring="softmax", norm_topk_prob=False)
        if v2
        else dict(
            # Mistral 4's: a softmax, no bias (its Mistral4TopkRouter)
            moe_scoring="softmax" if architecture == "mistral4" else "sigmoid",
            moe_norm_eps=_NORM_EPS,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            moe_selection_bias=architecture != "mistral4",  # V3's e_score_correction_bias
            moe_groups=int(config.get("n_group") or 1),
            moe_topk_groups=int(config.get("topk_group") or 1),
        )
    )
    return dict(
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        **latent_cache_fields(int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])),
        mla_rope_interleaved=v2 or bool(config.get("rope_interleave", True)),
        intermediate_size=int(config.get("intermediate_size") or width),
        num_experts=int(config["n_routed_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=width,
        dense_layers=dense,
        shared_expert_intermediate_size=width * int(config.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        **router,
    )


def deepseek_gguf_fields(
    meta: dict[str, Any], tensors: dict[str, Any], path: Path, arch: str = DEEPSEEK_GGUF
) -> dict[str, Any]:
    """ModelArch fields of a deepseek2 (or mistral4) GGUF beyond the shared ones and the MoE
    ones (gguf_moe_fields.py): its attention's shapes and its router; a deepseek2's
    architecture by the router (DeepSeek-V2's softmax, V3's sigmoid: llama.cpp writes both as
    deepseek2)."""

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    gating = meta.get(f"{arch}.expert_gating_func", 1)  # llama.cpp's default: a softmax
    if gating not in _GGUF_SCORINGS:
        raise ValueError(f"{path}: {arch}.expert_gating_func {gating!r} is not supported")
    rope, kv_lora_rank = int(need("rope.dimension_count")), int(need("attention.kv_lora_rank"))
    qk_head_dim = int(need("attention.key_length_mla"))
    cache = (int(need("attention.key_length")), int(need("attention.head_count_kv")))
    if cache != (kv_lora_rank + rope, 1):  # what the converter writes, and the cache holds
        raise ValueError(
            f"{path}: {arch}.attention.key_length {cache[0]} and head_count_kv {cache[1]}: "
            f"expected kv_lora_rank + rope dims {kv_lora_rank + rope} and 1"
        )
    blocks, nextn = int(need("block_count")), int(meta.get(f"{arch}.nextn_predict_layers", 0))
    if not 0 <= nextn < blocks:
        raise ValueError(f"{path}: {arch}.nextn_predict_layers {nextn} of {blocks} blocks")
    ours = "deepseek_v3" if gating == 2 else "deepseek_v2"
    return dict(
        q_lora_rank=int(meta.get(f"{arch}.attention.q_lora_rank", 0)),
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_head_dim - rope,
        v_head_dim=int(need("attention.value_length_mla")),
        architecture="mistral4" if arch == MISTRAL4_GGUF else ours,
        attention_bias="blk.0.attn_kv_a_mqa.bias" in tensors,
        num_hidden_layers=blocks - nextn,
        mla_rope_interleaved=True,  # llama.cpp's NORM rope, on the checkpoint's layout
        moe_scoring=_GGUF_SCORINGS[gating],
        moe_norm_eps=_NORM_EPS if gating == 2 or arch == MISTRAL4_GGUF else 0.0,
        routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale") or 1.0),
    )


def deepseek_gguf_yarn(
    scaling: dict[str, Any] | None, meta: dict[str, Any], arch: str = DEEPSEEK_GGUF
) -> dict | None:
    """A deepseek2 (mistral4) GGUF's YaRN: llama.cpp reads its yarn_log_multiplier as 0.1 *
    the config's mscale_all_dim, and takes mscale equal to it (so cos/sin are unscaled)."""
    log_multiplier = float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    if scaling is None or scaling.get("rope_type") != "yarn" or not log_multiplier:
        return scaling
    mscale = log_multiplier / _GGUF_LOG_MULTIPLIER_SCALE
    return {**scaling, "mscale": mscale, "mscale_all_dim": mscale}


def joined_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """HF's kv_b_proj [H * (nope + v), c] from llama.cpp's split of it: attn_k_b [H, c, nope]
    (each head's W_UK transposed) and attn_v_b [H, v, c]; each head's W_UK rows, then its W_UV
    rows."""
    kv_lora_rank = k_b.shape[1]
    return np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(-1, kv_lora_rank)


def latent_cache_fields(kv_lora_rank: int, rope: int) -> dict[str, int]:
    """The cache's shape: one KV head of the latent and the shared turned key."""
    return dict(head_dim=kv_lora_rank + rope, num_key_value_heads=1, rotary_dim=rope)
