"""Granite 4.0 (GraniteMoeHybrid) shapes beyond Granite 3's (L2; no torch): which layers are
Mamba2 mixers (model/mamba2.py) and their sizes. hf_loader joins these ModelArch fields to the
rest; a granitehybrid GGUF's are read in loader/mamba_config.py.

- `layer_types` (or `layers_block_type`) names each layer "mamba" (transformers 5 saves
  "linear_attention") or "attention" ("full_attention"). The 4.0-H models mix them; the
  attention-only ones (granite-4.0-micro) have none of the first kind.
- A mixer has `mamba_n_heads` heads of `mamba_d_head` channels ("auto": mamba_expand × hidden
  / heads), a state of `mamba_d_state` per channel, B and C in `mamba_n_groups` groups, a conv
  of `mamba_d_conv` taps (with a bias: `mamba_conv_bias`), projections with a bias where
  `mamba_proj_bias`, and scans in chunks of `mamba_chunk_size`; `time_step_limit` clamps dt.
- Experts (the 4.0-H Tiny and Small models: `num_local_experts` of `intermediate_size`, top
  `num_experts_per_tok` softmaxed among themselves) run beside the shared MLP, which is added
  to every token's routed sum ungated (model/moe.py's shared expert).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenbus.loader.mamba_config import dt_limit

MAMBA_KINDS = ("mamba", "linear_attention")
ATTENTION_KINDS = ("attention", "full_attention")


def granite_hybrid_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch's MLP width (its shared MLP's), recurrent and MoE fields of a
    GraniteMoeHybrid config (the width alone for a dense model whose every layer attends)."""
    num_layers = int(config["num_hidden_layers"])
    if config.get("shared_intermediate_size") is None:
        raise ValueError(f"{path}: missing 'shared_intermediate_size'")
    # its MLP is the shared MLP (beside experts, their shared expert of that width)
    mlp = dict(_experts(config), intermediate_size=int(config["shared_intermediate_size"]))
    kinds = config.get("layer_types") or config.get("layers_block_type")
    if kinds is None or len(kinds) != num_layers or set(kinds) - {*MAMBA_KINDS, *ATTENTION_KINDS}:
        raise ValueError(
            f"{path}: layer_types must name 'mamba' or 'attention' for each of the "
            f"{num_layers} layers, got {kinds!r}"
        )
    mamba = tuple(i for i, kind in enumerate(kinds) if kind in MAMBA_KINDS)
    if not mamba:
        return mlp
    hidden, heads = int(config["hidden_size"]), int(config.get("mamba_n_heads", 128))
    head_dim = config.get("mamba_d_head", "auto")
    inner = int(config.get("mamba_expand", 2)) * hidden
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ValueError(
            f"{path}: mamba_n_heads × mamba_d_head ({heads} × {head_dim}) must be "
            f"mamba_expand × hidden_size ({inner})"
        )
    return dict(
        mlp,
        recurrent_layers=mamba,
        conv_kernel=int(config.get("mamba_d_conv", 4)),
        conv_bias=bool(config.get("mamba_conv_bias", True)),
        mamba_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state=int(config.get("mamba_d_state", 256)),
        mamba_groups=int(config.get("mamba_n_groups", 1)),
        mamba_chunk=int(config.get("mamba_chunk_size", 256)),
        mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
        mamba_dt_limit=dt_limit(config.get("time_step_limit")),
    )


def _experts(config: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's MoE fields: its experts, the shared MLP as their ungated shared expert; {}
    without experts (the shared MLP is then the dense MLP)."""
    num_experts = int(config.get("num_local_experts") or 0)
    if not num_experts:
        return {}
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["intermediate_size"]),
        norm_topk_prob=True,  # softmax over the top k logits
        shared_expert_intermediate_size=int(config["shared_intermediate_size"]),
        shared_expert_gated=False,
    )
