"""MiniMax-M2 shapes (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1, M2.5; L2, no torch): what its
config.json and llama.cpp's `minimax-m2` GGUF say beyond a Llama's. hf_loader / gguf_loader
join these ModelArch fields to the rest.

- Attention: q and k RMSNormed over the whole projection (OLMo 2's; its `qk_norm_type`
  "per_layer"), the rotary turning the first `rotary_dim` dims of each head (transformers 5:
  rope_parameters' partial_rotary_factor) in NeoX's layout.
- MLP: every layer Mixtral's sparse MoE block (`block_sparse_moe`, experts' w1 / w3 / w2 of
  `intermediate_size`), routed by each expert's sigmoid, the top k chosen by score +
  `e_score_correction_bias` and weighed by the scores renormalised over the k (no epsilon, no
  scale: MiniMaxM2TopKRouter). No shared expert.
- A minimax-m2 GGUF says the experts' width as expert_feed_forward_length, the rotary's as
  rope.dimension_count, the sigmoid as expert_gating_func 2; llama.cpp always renormalises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MINIMAX_M2_GGUF = "minimax-m2"


def minimax_m2_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a MiniMaxM2ForCausalLM config beyond the shared ones."""
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
        if not config.get(key):
            raise ValueError(f"{path}: a MiniMaxM2ForCausalLM config needs {key!r}")
    if config.get("shared_intermediate_size"):
        raise ValueError(f"{path}: shared_intermediate_size is not supported for minimax_m2")
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"{path}: scoring_func {scoring!r} is not supported (only 'sigmoid')")
    return dict(
        num_experts=int(config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["intermediate_size"]),
        moe_selection_bias=True,
        moe_scoring="sigmoid",
        norm_topk_prob=True,
    )


def minimax_m2_partial_rotary(config: dict[str, Any]) -> dict[str, Any]:
    """The config with its rotary_dim (the released files' key) as the partial_rotary_factor
    transformers 5 derives from it, unless rope_parameters name one already."""
    rotary_dim, head_dim = config.get("rotary_dim"), config.get("head_dim")
    if rotary_dim is None or not head_dim:
        return config
    return {"partial_rotary_factor": int(rotary_dim) / int(head_dim), **config}


def minimax_m2_gguf_fields(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a minimax-m2 GGUF beyond the shared MoE ones (its experts' width,
    bias and renormalising: gguf_moe_fields.py)."""
    gating = meta.get(f"{MINIMAX_M2_GGUF}.expert_gating_func", 2)
    if gating != 2:
        raise ValueError(
            f"{path}: {MINIMAX_M2_GGUF}.expert_gating_func must be 2 (sigmoid), got {gating!r}"
        )
    return dict(moe_scoring="sigmoid")
