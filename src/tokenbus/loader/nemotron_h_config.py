"""Nemotron-H shapes (L2; no torch): its config.json beyond a Llama's. hf_loader joins these
ModelArch fields to the rest.

- `layers_block_type` ("linear_attention", "full_attention", "mlp"), or the older
  `hybrid_override_pattern` ("M", "*", "-"), gives each layer's one mixer; its length is the
  layer count (num_hidden_layers is ignored, as transformers ignores it).
- The Mamba2 mixers: `mamba_num_heads` heads of `mamba_head_dim`, `ssm_state_size`, B and C in
  `n_groups` groups, a conv of `conv_kernel` taps (`use_conv_bias`), projections with a bias
  where `use_bias`, scans in chunks of `chunk_size`; `time_step_limit` clamps dt.
- Attention turns no rotary; the MLP is `mlp_hidden_act` relu2, ungated.
- Mixture-of-experts blocks ("moe", "E": Nemotron 3) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenbus.loader.mamba_config import dt_limit

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def nemotron_h_kinds(config: dict[str, Any], path: Path) -> list[str]:
    """Each layer's mixer: "linear_attention", "full_attention" or "mlp"."""
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if kinds is None:
        kinds = [_PATTERN.get(c, c) for c in config.get("hybrid_override_pattern") or ""]
    if not kinds or set(kinds) - {"linear_attention", "full_attention", "mlp"}:
        raise ValueError(
            f"{path}: Nemotron-H layers must be 'linear_attention', 'full_attention' or 'mlp' "
            f"(mixture-of-experts blocks are not supported), got {kinds!r}"
        )
    return kinds


def nemotron_h_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a NemotronHForCausalLM config beyond the shared ones."""
    kinds = nemotron_h_kinds(config, path)
    act = config.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"{path}: mlp_hidden_act must be 'relu2', got {act!r}")
    num_layers = len(kinds)
    heads, head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
    return dict(
        num_hidden_layers=num_layers,
        hidden_act="relu2",
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        nope_layers=tuple(range(num_layers)),  # no layer turns a rotary
        recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        mlp_only_layers=tuple(i for i, kind in enumerate(kinds) if kind == "mlp"),
        conv_kernel=int(config.get("conv_kernel", 4)),
        conv_bias=bool(config.get("use_conv_bias", True)),
        mamba_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state=int(config.get("ssm_state_size", 128)),
        mamba_groups=int(config.get("n_groups", 8)),
        mamba_chunk=int(config.get("chunk_size", 128)),
        mamba_proj_bias=bool(config.get("use_bias", False)),
        mamba_dt_limit=dt_limit(config.get("time_step_limit")),
    )
