"""What the families with Mamba2 mixers (model/mamba2.py: Granite 4.0-H, Nemotron-H) read alike
(L2; no torch): config.json's dt clamp, and llama.cpp's GGUFs of them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def dt_limit(value: Any) -> tuple[float, float]:
    """`time_step_limit` (dt's clamp) as floats: a JSON number, or transformers 5's encoding of
    a float JSON has none for ({"__float__": "Infinity"}); absent: no clamp."""
    bounds = value or (0.0, "inf")
    low, high = (float(b["__float__"] if isinstance(b, dict) else b) for b in bounds)
    return low, high


# llama.cpp's `granitehybrid` GGUF (its GraniteHybridModel; nemotron_h too, whose converter is
# its subclass): a layer is a Mamba2 mixer where its head_count_kv is 0 (and, in nemotron_h,
# its feed_forward_length too: an MLP-only layer has one); ssm.* keys give the mixers' sizes
# (time_step_rank: the heads, inner_size: heads × head_dim); rope.scaling.finetuned false means
# no layer turns a rotary (the 4.0-H models, Nemotron-H). A is stored as -exp(A_log) (read back
# as A_log here), A and D as [H, 1], the norm's weight as [G, I / G].
GRANITE_HYBRID_GGUF = "granitehybrid"
NEMOTRON_H_GGUF = "nemotron_h"
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


def mamba_hybrid_gguf_fields(
    meta: dict[str, Any], arch: str, num_layers: int, tensors: Iterable[str], path: Path
) -> dict[str, Any]:
    """ModelArch fields of a granitehybrid or nemotron_h GGUF beyond the shared ones: its
    Mamba2 layers and their sizes, the attention layers' KV heads, NoPE where it says so; a
    nemotron_h's MLP-only layers (a feed_forward_length of their own, the others 0) too."""

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    kv_heads = need("attention.head_count_kv")
    if not isinstance(kv_heads, list) or len(kv_heads) != num_layers:
        kv_heads = [kv_heads] * num_layers  # one count: every layer attends
    widths = need("feed_forward_length")
    if not isinstance(widths, list) or len(widths) != num_layers:
        widths = [0] * num_layers  # one width: every layer has an MLP beside its mixer
    mamba = tuple(i for i, (n, w) in enumerate(zip(kv_heads, widths)) if not n and not w)
    fields: dict[str, Any] = {"num_key_value_heads": max(kv_heads)}
    if any(widths):  # nemotron_h: its MLP-only layers
        fields.update(
            intermediate_size=max(widths),
            hidden_act="relu2",
            mlp_only_layers=tuple(i for i, w in enumerate(widths) if w),
        )
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
