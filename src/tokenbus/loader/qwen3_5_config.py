"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next shapes and names (L2; no torch): what their config.json
says beyond a Qwen3's. hf_loader joins these ModelArch fields to the rest.

- Layers: `layer_types` ("linear_attention" or "full_attention"; older configs give
  `full_attention_interval`, every n-th layer attending) make ModelArch.recurrent_layers: Gated
  DeltaNet layers (model/gated_delta_net.py) of `linear_num_key_heads` key heads of
  `linear_key_head_dim` and `linear_num_value_heads` value heads of `linear_value_head_dim`, a
  causal conv of `linear_conv_kernel_dim` taps.
- Attention: Qwen3's with per-head q/k norms, its output gated (q_proj projects each head's
  queries, then its gate: split at load into q_proj and gate_proj), a partial rotary
  (`partial_rotary_factor`, 0.25). Its interleaved multimodal rotary (`mrope_section`) turns a
  text token's dims by one position in all three sections: a plain rotary.
- Norms scale by (1 + w) (model/qwen3_5.py stores 1 + w), but the Gated DeltaNet's output norm.
- Qwen3.5-MoE: every MLP a sparse MoE block (model/moe.py) of `num_experts` experts, softmax
  routing with the top k renormalised, and a shared expert behind a sigmoid gate (Qwen2-MoE's).
  Its experts come per expert, or stacked as transformers 5 holds them
  (experts.gate_up_proj [E, 2I, hidden], experts.down_proj [E, hidden, I]).
- Qwen3-Next (80B-A3B): Qwen3.5-MoE's layers (its MoE fields Qwen3-MoE's: mlp_only_layers and
  decoder_sparse_step keep dense MLPs), the Gated DeltaNet's projections fused per key head:
  in_proj_qkvz (each key head's q, k, its value heads' v, then their z) and in_proj_ba (its
  value heads' b, then their a), split into Qwen3.5's at load (model/qwen3_5.py).

llama.cpp's `qwen35` GGUF: ssm.* keys give the Gated DeltaNet's sizes (group_count: key heads,
time_step_rank: value heads, state_size: a key head's dims, inner_size: all value dims),
attention.recurrent_layers (or full_attention_interval) which layers they are; block_count
counts the multi-token-prediction blocks after the model's (nextn_predict_layers), whose
tensors are left unread. Its converter reorders the value heads from grouped to tiled (value
head j reads key head j % K: ModelArch.delta_v_tiled) in every tensor that holds them, names
the linear attention's tensors attn_qkv / attn_gate / ssm_beta / ssm_alpha / ssm_*, stores A
as -exp(A_log) and every norm but ssm_norm as 1 + w (both given back as HF's here). `qwen35moe`
adds the experts (no feed_forward_length: the shared expert's width stands in); `qwen3next`
keeps HF's grouped value heads, and b and a fused per key head as ssm_ba.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

LAYER_KINDS = ("linear_attention", "full_attention")


def qwen3_5_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a Qwen3.5 text config beyond the shared ones."""
    num_layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is None:
        interval = int(config.get("full_attention_interval", 4))
        kinds = [LAYER_KINDS[(i + 1) % interval == 0] for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - set(LAYER_KINDS):
        raise ValueError(
            f"{path}: layer_types must name 'linear_attention' or 'full_attention' for each "
            f"of the {num_layers} layers, got {kinds!r}"
        )
    kernel = int(config.get("linear_conv_kernel_dim", 4))
    if kernel < 2:
        raise ValueError(f"{path}: linear_conv_kernel_dim must be >= 2, got {kernel}")
    return dict(
        recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        conv_kernel=kernel,
        delta_k_heads=int(config.get("linear_num_key_heads", 16)),
        delta_v_heads=int(config.get("linear_num_value_heads", 32)),
        delta_k_dim=int(config.get("linear_key_head_dim", 128)),
        delta_v_dim=int(config.get("linear_value_head_dim", 128)),
        attn_output_gate=True,
    )


QWEN3_5_GGUF = "qwen35"
QWEN3_5_GGUF_ARCHITECTURES = (QWEN3_5_GGUF, "qwen35moe", "qwen3next")
QWEN3_5_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # ours, in the same order
QWEN3_5_GGUF_BLOCK_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",  # qwen3next's b and a, fused per key head
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "post_attention_norm": "post_attention_layernorm",
}
# HF names that are a parameter themselves, not a module's weight or bias.
QWEN3_5_PARAMETER_NAMES = ("linear_attn.dt_bias", "linear_attn.A_log")


def qwen3_5_moe_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a Qwen3.5-MoE text config beyond the shared ones: Qwen3.5's layers,
    its experts."""
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not config.get(key):
            raise ValueError(f"{path}: a Qwen3.5-MoE config needs {key!r}")
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return dict(
        # no dense MLP: the width a dense one would have is the shared expert's
        intermediate_size=shared or int(config["moe_intermediate_size"]),
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=True,  # its router always renormalises the top k
        shared_expert_intermediate_size=shared,
        **qwen3_5_hf_fields(config, path),
    )


def qwen3_5_gguf_fields(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """ModelArch fields of a qwen35 GGUF beyond the shared ones (the layer count without the
    multi-token-prediction blocks among them)."""

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    num_layers = int(need("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0))
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(meta.get(f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    v_heads = int(need("ssm.time_step_rank"))
    fields: dict[str, Any] = {}
    if f"{arch}.feed_forward_length" not in meta:  # qwen35moe: no dense MLP
        shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
        fields["intermediate_size"] = int(shared or need("expert_feed_forward_length"))
    return dict(
        **fields,
        num_hidden_layers=num_layers,
        recurrent_layers=tuple(i for i in range(num_layers) if recurrent[i]),
        conv_kernel=int(need("ssm.conv_kernel")),
        delta_k_heads=int(need("ssm.group_count")),
        delta_v_heads=v_heads,
        delta_k_dim=int(need("ssm.state_size")),
        delta_v_dim=int(need("ssm.inner_size")) // v_heads,
        delta_v_tiled=arch != "qwen3next",  # qwen3next's converter keeps HF's order
        attn_output_gate=True,
    )


def qwen3_5_gguf_tensor(name: str, tensor):
    """A qwen35 GGUF tensor as HF holds it: A back to A_log, each (1 + w) norm back to w."""
    if name.endswith(".linear_attn.A_log"):
        return (-tensor).log().reshape(-1)
    if name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
        return tensor - 1.0
    return tensor


def without_mtp(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A Qwen3.5 checkpoint's tensors but its multi-token-prediction head's (mtp.*)."""
    return ((name, tensor) for name, tensor in weights if not name.startswith("mtp."))
