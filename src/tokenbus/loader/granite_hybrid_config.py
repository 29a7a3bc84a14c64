"""Granite 4.0 (GraniteMoeHybrid) shapes beyond Granite 3's (L2; no torch): which layers are
Mamba2 mixers (model/mamba2.py) and their sizes. hf_loader joins these ModelArch fields to the
rest.

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

from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAMBA_KINDS = ("mamba", "linear_attention")
ATTENTION_KINDS = ("attention", "full_attention")


def granite_hybrid_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch's recurrent and MoE fields of a GraniteMoeHybrid config ({} for a dense
    model whose every layer attends)."""
    num_layers = int(config["num_hidden_layers"])
    experts = _experts(config)
    kinds = config.get("layer_types") or config.get("layers_block_type")
    if kinds is None or len(kinds) != num_layers or set(kinds) - {*MAMBA_KINDS, *ATTENTION_KINDS}:
        raise ValueError(
            f"{path}: layer_types must name 'mamba' or 'attention' for each of the "
            f"{num_layers} layers, got {kinds!r}"
        )
    mamba = tuple(i for i, kind in enumerate(kinds) if kind in MAMBA_KINDS)
    if not mamba:
        return experts
    hidden, heads = int(config["hidden_size"]), int(config.get("mamba_n_heads", 128))
    head_dim = config.get("mamba_d_head", "auto")
    inner = int(config.get("mamba_expand", 2)) * hidden
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ValueError(
            f"{path}: mamba_n_heads × mamba_d_head ({heads} × {head_dim}) must be "
            f"mamba_expand × hidden_size ({inner})"
        )
    limit = [_number(bound) for bound in config.get("time_step_limit") or (0.0, "inf")]
    return dict(
        experts,
        recurrent_layers=mamba,
        conv_kernel=int(config.get("mamba_d_conv", 4)),
        conv_bias=bool(config.get("mamba_conv_bias", True)),
        mamba_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state=int(config.get("mamba_d_state", 256)),
        mamba_groups=int(config.get("mamba_n_groups", 1)),
        mamba_chunk=int(config.get("mamba_chunk_size", 256)),
        mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
        mamba_dt_limit=(float(limit[0]), float(limit[1])),
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


def _number(value: Any) -> float:
    """A JSON number, or transformers 5's encoding of a float JSON has none for
    ({"__float__": "Infinity"})."""
    return float(value["__float__"] if isinstance(value, dict) else value)


# llama.cpp's `granitehybrid` GGUF (its GraniteHybridModel): a layer is a Mamba2 mixer where its
# head_count_kv is 0; ssm.* keys give the mixers' sizes (time_step_rank: the heads, inner_size:
# heads × head_dim); rope.scaling.finetuned false means no layer turns a rotary (the 4.0-H
# models). A is stored as -exp(A_log) (read back as A_log here), A and D as [H, 1], the norm's
# weight as [G, I / G].
GRANITE_HYBRID_GGUF = "granitehybrid"
GRANITE_HYBRID_GGUF_BLOCK_NAMES = {
    # the shared MLP beside experts (dense models write it as ffn_gate / ffn_up / ffn_down)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}
# HF names that are a parameter themselves, not a module's weight or bias.
MAMBA_PARAMETER_NAMES = ("mamba.dt_bias", "mamba.A_log", "mamba.D")


def granite_hybrid_gguf_fields(
    meta: dict[str, Any], num_layers: int, tensors: Iterable[str], path: Path
) -> dict[str, Any]:
    """ModelArch fields of a granitehybrid GGUF beyond Granite's: its Mamba2 layers and their
    sizes, the attention layers' KV heads, NoPE where it says so."""
    arch = GRANITE_HYBRID_GGUF

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    kv_heads = need("attention.head_count_kv")
    if not isinstance(kv_heads, list) or len(kv_heads) != num_layers:
        kv_heads = [kv_heads] * num_layers  # one count: every layer attends
    mamba = tuple(i for i, n in enumerate(kv_heads) if not n)
    fields: dict[str, Any] = {"num_key_value_heads": max(kv_heads)}
    if not meta.get(f"{arch}.rope.scaling.finetuned", True):
        fields["nope_layers"] = tuple(range(num_layers))
    if not mamba:
        return fields
    heads = int(need("ssm.time_step_rank"))
    return dict(
        fields,
        recurrent_layers=mamba,
        conv_kernel=int(need("ssm.conv_kernel")),
        conv_bias=f"blk.{mamba[0]}.ssm_conv1d.bias" in set(tensors),
        mamba_heads=heads,
        mamba_head_dim=int(need("ssm.inner_size")) // heads,
        mamba_state=int(need("ssm.state_size")),
        mamba_groups=int(need("ssm.group_count")),
    )


def mamba_gguf_tensor(name: str, tensor):
    """A GGUF mixer tensor as HF holds it: A back to A_log, A / D / the norm flat."""
    if name.endswith(".mamba.A_log"):
        return (-tensor).log().reshape(-1)
    if name.endswith((".mamba.D", ".mamba.norm.weight")):
        return tensor.reshape(-1)
    return tensor
