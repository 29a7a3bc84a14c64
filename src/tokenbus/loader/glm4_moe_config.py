"""GLM-4.5 shapes (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7; L2, no torch):
what its config.json and llama.cpp's `glm4moe` GGUF say beyond a Llama's. hf_loader /
gguf_loader join these ModelArch fields to the rest.

- Attention: q/k/v with biases (`attention_bias`), o_proj without; a per-head q/k RMSNorm where
  `use_qk_norm` says (GLM-4.5's 355B model); the rotary turns the first half of each head
  (`partial_rotary_factor`, 0.5 where the config names none) in NeoX's layout, so no rows are
  reordered (unlike GLM-4's).
- MLP: the first `first_k_dense_replace` layers dense, the others `n_routed_experts` experts of
  `moe_intermediate_size`, `num_experts_per_tok` a token, and an ungated shared MLP of
  `n_shared_experts` experts' width. The router is DeepSeek-V3's: each expert's sigmoid, the top
  k chosen by score + `e_score_correction_bias` within the best `topk_group` of `n_group`
  groups, weighed by the scores renormalised (`norm_topk_prob`, 1e-20 in the sum) and scaled by
  `routed_scaling_factor` (model/moe.py).
- Its multi-token-prediction layers (`num_nextn_predict_layers` of them, numbered after the
  model's layers: model.layers.46.* in GLM-4.5-Air) are not read, as transformers leaves them.
  llama.cpp's converter counts them in block_count and says how many in nextn_predict_layers;
  their blocks are skipped too.
- Solar Open (SolarOpenForCausalLM, Upstage's 102B-A12B) is GLM-4.5's MoE in every layer under
  Llama's attention (no biases, no q/k norms, the whole head turning), without MTP layers or a
  dense width; llama.cpp writes it as glm4moe.
- dots.llm1 (Dots1ForCausalLM, rednote's 142B-A14B) is GLM-4.5's MoE under Qwen3's attention
  (per-head q/k norms always, the whole head turning; its windows as Qwen2's `max_window_layers`
  or `layer_types` say), its transformers defaults no dense layer and no renormalising; llama.cpp
  writes it as `dots1` (Qwen2-MoE's keys, the pre-MLP norm as ffn_norm).
- A glm4moe GGUF: expert_shared_count experts' width for the shared MLP, expert_weights_scale
  and expert_weights_norm (off where absent, as llama.cpp reads it), expert_gating_func 2
  (sigmoid; absent means the same to llama.cpp), the router's bias as exp_probs_b; the groups
  as expert_group_count and expert_group_used_count (gguf_loader reads them for any
  architecture, as llama.cpp's graph applies them to any).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

GLM4_MOE_GGUF = "glm4moe"
# llama.cpp's expert_gating_func for a sigmoid (gguf.ExpertGatingFuncType.SIGMOID)
_GGUF_SIGMOID = 2
# DeepSeek-V3's router keeps the renormalising sum off 0 by this much (Glm4MoeTopkRouter)
_NORM_EPS = 1e-20
_ROUTER = dict(moe_scoring="sigmoid", moe_norm_eps=_NORM_EPS)
DOTS1_GGUF = "dots1"
# (HF class, the leading dense layers' and norm_topk_prob's transformers defaults) by family
_FAMILIES = {
    "glm4_moe": ("Glm4MoeForCausalLM", 1, True),
    "solar_open": ("SolarOpenForCausalLM", 0, True),
    "dots1": ("Dots1ForCausalLM", 0, False),
}
# dots.llm1's GGUF: the shared MLP and the router's bias under GLM-4.5's HF names
DOTS1_GGUF_BLOCK_NAMES = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}


def glm4_moe_hf_fields(
    config: dict[str, Any], path: Path, family: str = "glm4_moe"
) -> dict[str, Any]:
    """ModelArch fields of a Glm4MoeForCausalLM config (a SolarOpenForCausalLM or
    Dots1ForCausalLM one: `family`) beyond the shared ones."""
    name, first_dense, renormalised = _FAMILIES[family]
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not config.get(key):
            raise ValueError(f"{path}: a {name} config needs {key!r}")
    num_layers = int(config["num_hidden_layers"])
    width = int(config["moe_intermediate_size"])
    shared = width * int(config.get("n_shared_experts") or 0)
    solar = family == "solar_open"
    dense = 0 if solar else int(config.get("first_k_dense_replace", first_dense))
    return dict(
        # Solar Open has no dense MLP: the shared expert's width stands in (Qwen3.5-MoE's way)
        intermediate_size=int(config.get("intermediate_size") or shared or width),
        num_experts=int(config["n_routed_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=width,
        norm_topk_prob=bool(config.get("norm_topk_prob", renormalised)),
        dense_layers=tuple(range(min(dense, num_layers))),
        shared_expert_intermediate_size=shared,
        shared_expert_gated=False,
        moe_selection_bias=True,  # e_score_correction_bias: in every checkpoint
        moe_groups=int(config.get("n_group") or 1),
        moe_topk_groups=int(config.get("topk_group") or 1),
        attn_qk_norm=family == "dots1" or (not solar and bool(config.get("use_qk_norm", False))),
        **_ROUTER,
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
    )


def glm4_moe_gguf_fields(
    meta: dict[str, Any], tensors: dict[str, Any], path: Path
) -> dict[str, Any]:
    """ModelArch fields of a glm4moe GGUF beyond the shared MoE ones (gguf_moe_fields.py):
    its layers without the multi-token-prediction blocks, its router, its q/k norms."""
    arch = GLM4_MOE_GGUF
    gating = meta.get(f"{arch}.expert_gating_func", _GGUF_SIGMOID)
    if gating != _GGUF_SIGMOID:
        raise ValueError(f"{path}: {arch}.expert_gating_func must be 2 (sigmoid), got {gating!r}")
    blocks = meta.get(f"{arch}.block_count")
    if blocks is None:
        raise ValueError(f"{path}: missing GGUF metadata {arch}.block_count")
    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    if not 0 <= nextn < blocks:
        raise ValueError(f"{path}: {arch}.nextn_predict_layers {nextn} of {blocks} blocks")
    fields: dict[str, Any] = {}
    if f"{arch}.feed_forward_length" not in meta:  # Solar Open's: no dense MLP
        width = int(meta.get(f"{arch}.expert_feed_forward_length", 0))
        fields["intermediate_size"] = width * int(meta.get(f"{arch}.expert_shared_count", 1) or 1)
    return dict(
        **fields,
        num_hidden_layers=int(blocks) - nextn,
        attn_qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **_ROUTER,
        routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale", 1.0)),
    )


def dots1_gguf_fields(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a dots1 GGUF beyond the shared MoE ones: its router (DeepSeek-V3's
    sigmoid, whatever else the file says is refused), its q/k norms."""
    gating = meta.get(f"{DOTS1_GGUF}.expert_gating_func", _GGUF_SIGMOID)
    if gating != _GGUF_SIGMOID:
        raise ValueError(
            f"{path}: {DOTS1_GGUF}.expert_gating_func must be 2 (sigmoid), got {gating!r}"
        )
    return dict(
        attn_qk_norm=True,
        **_ROUTER,
        routed_scaling_factor=float(meta.get(f"{DOTS1_GGUF}.expert_weights_scale", 1.0)),
    )


def without_mtp_layers(
    weights: Iterator[tuple[str, Any]], num_layers: int
) -> Iterator[tuple[str, Any]]:
    """A GLM-4.5 checkpoint's tensors but its multi-token-prediction layers' (model.layers.N.*
    for N >= num_layers)."""
    for name, tensor in weights:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
            continue
        yield name, tensor
