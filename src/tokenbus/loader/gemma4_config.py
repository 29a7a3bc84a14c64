"""Gemma 4 (text) shapes: what its config.json or llama.cpp's gemma4 GGUF says beyond a Llama
decoder's (L2). Each reader returns ModelArch fields; hf_loader / gguf_loader join them
(model/gemma4.py says what each does).

- Layer kinds: `layer_types` (default: five local, then a global one; the last layer global
  whatever it says, as Gemma4TextConfig forces it); the local layers' heads
  are `head_dim` over `num_key_value_heads` KV heads, the global ones' `global_head_dim` (512)
  over `num_global_key_value_heads` where attention_k_eq_v (else the local count). transformers
  writes both into `per_layer_config`, keyed by the global layers' indices.
- RoPE (`rope_parameters` by layer type): the local layers' default rope of their base, the
  global layers' "proportional" one (partial_rotary_factor 0.25 of the angles turn).
- KV sharing: the last num_kv_shared_layers layers read the last earlier layer of their kind
  (Gemma 3n's rule); with use_double_wide_mlp their MLPs are twice intermediate_size.
- llama.cpp's converter writes the head sizes as `key_length` (global) and `key_length_swa`,
  the KV heads per layer as an array, the MLP widths per layer where they differ, the global
  layers' proportional rope as a `rope_freqs` tensor (factor 1e30 on the still angles) and the
  norms as they are (w); the 26B-A4B's router scales as `ffn_gate_inp.scale` and
  `ffn_down_exps.scale`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenbus.loader.gemma3n_config import kv_shared_layers
from tokenbus.loader.gemma_config import GEMMA_ACTIVATION
from tokenbus.loader.layer_kinds import (
    full_attention_rope,
    gguf_local_layers,
    hf_local_layers,
    rope_by_layer_type,
    windows,
)

GEMMA4_GGUF = "gemma4"
_PATTERN = 6  # five local layers, then a global one (Gemma4TextConfig's default)
_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
_LOCAL_THETA, _GLOBAL_THETA = 10_000.0, 1_000_000.0
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_THETA},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": _GLOBAL_THETA,
    },
}
# llama.cpp's names of Gemma 4's own tensors -> HF's, beside Gemma 3n's per-layer-input ones
GEMMA4_GGUF_BLOCK_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
    # the 26B-A4B's experts: the router, its per-channel and per-expert scales, their norms
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# HF names that are a parameter themselves, not a module's `.weight`
GEMMA4_PARAMETER_NAMES = ("layer_scalar", "router.scale", "router.per_expert_scale")


def gemma4_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a Gemma 4 text config.json (the rope's and head sizes too)."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise ValueError(f"{path}: hidden_activation {activation!r} is not supported for gemma4")
    if config.get("use_bidirectional_attention") == "all":
        raise ValueError(f"{path}: use_bidirectional_attention='all' is not supported")
    num_layers = int(config["num_hidden_layers"])
    local = hf_local_layers(config, path, num_layers, _PATTERN)
    local[-1] = False  # Gemma4TextConfig forces the last layer global (with a warning)
    head_dim = int(config.get("head_dim") or 256)
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    global_dim, global_kv = _hf_global_shape(config, local, kv_heads, k_eq_v)
    shapes = [(kv_heads, head_dim) if is_local else (global_kv, global_dim) for is_local in local]
    rope = config.get("rope_parameters") or _DEFAULT_ROPE
    global_rope, local_theta = rope_by_layer_type(rope, path)
    global_theta, global_scaling = full_attention_rope(
        global_rope["rope_parameters"], path, _GLOBAL_THETA
    )
    shared = int(config.get("num_kv_shared_layers") or 0)
    width = int(config["intermediate_size"])
    per_layer = int(config.get("hidden_size_per_layer_input") or 0)
    return dict(
        hidden_act=GEMMA_ACTIVATION,
        head_dim=head_dim,
        num_key_value_heads=kv_heads,
        final_logit_softcapping=config.get("final_logit_softcapping"),
        sliding_windows=windows(local, int(config.get("sliding_window") or 512)),
        rope_theta=global_theta,
        rope_scaling=global_scaling,
        rope_local_theta=_LOCAL_THETA if local_theta is None else local_theta,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        kv_shared_layers=kv_shared_layers(local, shared),
        **_shape_fields(shapes, k_eq_v),
        **_width_fields(width, num_layers, shared, bool(config.get("use_double_wide_mlp"))),
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(config.get("vocab_size_per_layer_input") or 0) if per_layer else 0,
        **_hf_expert_fields(config, path),
    )


def gemma4_gguf_fields(meta: dict[str, Any], tensors: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of llama.cpp's gemma4 GGUF (the proportional rope comes back from its
    rope_freqs tensor: loader/gguf_rope.py)."""
    arch = GEMMA4_GGUF
    num_layers = int(meta[f"{arch}.block_count"])
    if not meta.get(f"{arch}.attention.sliding_window"):  # llama.cpp requires it too
        raise ValueError(f"{path}: missing GGUF metadata {arch}.attention.sliding_window")
    local = gguf_local_layers(meta, arch, num_layers, _PATTERN)
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * num_layers
    global_dim = int(meta[f"{arch}.attention.key_length"])
    local_dim = int(meta.get(f"{arch}.attention.key_length_swa", global_dim))
    shapes = [
        (int(kv), local_dim if is_local else global_dim) for kv, is_local in zip(kv_heads, local)
    ]
    shared = int(meta.get(f"{arch}.attention.shared_kv_layers", 0))
    widths = meta[f"{arch}.feed_forward_length"]
    widths = list(widths) if isinstance(widths, (list, tuple)) else [widths] * num_layers
    # k = v where a global layer has no attn_v tensor (llama.cpp's use_alternative_attention)
    global_layer = next((i for i in range(num_layers) if not local[i]), None)
    k_eq_v = global_layer is not None and f"blk.{global_layer}.attn_v.weight" not in tensors
    per_layer = int(meta.get(f"{arch}.embedding_length_per_layer_input", 0))
    table = tensors.get("per_layer_token_embd.weight")
    return dict(
        hidden_act=GEMMA_ACTIVATION,
        head_dim=local_dim,
        num_key_value_heads=shapes[0][0],
        final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
        sliding_windows=windows(local, meta[f"{arch}.attention.sliding_window"]),
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", _LOCAL_THETA)),
        kv_shared_layers=kv_shared_layers(local, shared),
        **_shape_fields(shapes, k_eq_v),
        intermediate_size=int(widths[0]),
        layer_intermediate_sizes=tuple(map(int, widths)) if len(set(widths)) > 1 else (),
        per_layer_input_size=per_layer,
        per_layer_vocab_size=table.shape[0] if per_layer and table is not None else 0,
    )


def _hf_expert_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The 26B-A4B's experts beside every layer's MLP (enable_moe_block), {} without."""
    if not config.get("enable_moe_block"):
        return {}
    num_experts, top_k = config.get("num_experts"), config.get("top_k_experts")
    width = config.get("moe_intermediate_size")
    if not (num_experts and top_k and width):
        raise ValueError(
            f"{path}: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
        )
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(width),
    )


def _hf_global_shape(
    config: dict[str, Any], local: list[bool], kv_heads: int, k_eq_v: bool
) -> tuple[int, int]:
    """(head size, KV heads) of the global layers: per_layer_config's entry of one (what
    transformers writes), else global_head_dim and (with k = v) num_global_key_value_heads."""
    # keyed by layer index as text, zero-padded to the widest index ("04" of 30 layers)
    overrides = {
        int(key): value
        for key, value in (config.get("per_layer_config") or {}).items()
        if str(key).isdigit()
    }
    first_global = next((i for i, is_local in enumerate(local) if not is_local), None)
    entry = overrides.get(first_global) or {}
    head_dim = entry.get("head_dim") or config.get("global_head_dim") or _GLOBAL_HEAD_DIM
    global_kv = config.get("num_global_key_value_heads") if k_eq_v else None
    return int(head_dim), int(entry.get("num_key_value_heads") or global_kv or kv_heads)


def _shape_fields(shapes: list[tuple[int, int]], k_eq_v: bool) -> dict[str, Any]:
    return dict(
        layer_kv_shapes=tuple(shapes) if len(set(shapes)) > 1 else (),
        attn_k_eq_v=k_eq_v,
    )


def _width_fields(width: int, num_layers: int, shared: int, double_wide: bool) -> dict[str, Any]:
    """The MLP widths: twice `width` on the last `shared` layers where double_wide."""
    if not (double_wide and shared):
        return dict(intermediate_size=width)
    widths = [width] * (num_layers - shared) + [2 * width] * shared
    return dict(intermediate_size=width, layer_intermediate_sizes=tuple(widths))
