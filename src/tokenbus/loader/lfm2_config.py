"""LFM2, LFM2-MoE and LFM3 shapes and names (L2; no torch): what their config.json and llama.cpp's
`lfm2` / `lfm2moe` GGUFs say beyond a Llama's. hf_loader / gguf_loader join these ModelArch
fields to the rest.

- Layers: `layer_types` ("conv" or "full_attention"; older configs list `full_attn_idxs`) make
  ModelArch.recurrent_layers: gated short convolutions of `conv_L_cache` taps
  (model/short_conv.py). A GGUF marks them with a head_count_kv of 0 and gives the taps as
  `shortconv.l_cache`.
- The MLP's width: with `block_auto_adjust_ff_dim`, 2/3 of `block_ff_dim` (the config's
  intermediate_size), times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`, as
  Lfm2MLP computes it; a GGUF's feed_forward_length is that width already.
- Names: HF's operator_norm / ffn_norm / feed_forward.w1, w3, w2 / out_proj / q_layernorm /
  k_layernorm / embedding_norm are the shared parts' input_layernorm / post_attention_layernorm
  / mlp.gate_proj, up_proj, down_proj / o_proj / q_norm / k_norm / model.norm; the conv's
  (conv.in_proj, conv.conv, conv.out_proj) stay. llama.cpp names the final norm
  token_embd_norm and the conv's tensors shortconv.*.
- LFM2-MoE: its experts' feed_forward.experts.N.w1, w3, w2 go by the same names under
  mlp.experts.N, the router feed_forward.gate is mlp.gate and feed_forward.expert_bias the
  selection bias model/moe.py loads (mlp.moe_statics.e_score_correction_bias, ERNIE's name;
  llama.cpp's exp_probs_b). An lfm2moe GGUF says its sigmoid scores by expert_gating_func 2.
- LFM3 (config.json only: llama.cpp has no lfm3 yet): "sliding_attention" layers too, each
  family of layers its own rope (lfm3_hf_fields), and sandwich blocks whose operator_norm /
  post_operator_norm / ffn_norm / post_ffn_norm are the shared sandwich's input_layernorm /
  post_attention_layernorm / pre_feedforward_layernorm / post_feedforward_layernorm; its
  attention is Qwen3's names (q_proj .. o_proj, q_norm, k_norm), its per-head gate g_proj the
  shared attention's gate_proj.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenbus.loader.layer_kinds import full_attention_rope, rope_by_layer_type, windows

LFM2_GGUF_ARCHITECTURES = ("lfm2", "lfm2moe")
LFM2_GGUF_GLOBAL_NAMES = {"token_embd_norm.weight": "model.norm.weight"}
LFM2_GGUF_BLOCK_NAMES = {
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    # LFM2-MoE's expert bias, by the name of the selection bias model/moe.py loads
    "exp_probs_b": "mlp.moe_statics.e_score_correction_bias",
}
# llama.cpp's expert_gating_func values: how a router's logits become probabilities
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}
_HF_LAYER_NAMES = {
    "operator_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
}
# LFM3's sandwich blocks: the norm before the MLP and the two after each sublayer
_HF_LFM3_LAYER_NAMES = {  # beside LFM2's (operator_norm's too)
    "post_operator_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
    "self_attn.g_proj": "self_attn.gate_proj",
}
# Lfm3Config's rope when the config names none: the sliding layers' default, the full ones'
_LFM3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.5,
    },
}
# A gated MLP's linears, under feed_forward
_HF_MLP_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def lfm2_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of an Lfm2ForCausalLM config beyond the shared ones."""
    width = int(config.get("block_ff_dim") or config["intermediate_size"])
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:  # Lfm2MLP rounds only here
            multiple = int(config.get("block_multiple_of", 256))
            width = int(multiplier * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return dict(intermediate_size=width, **_hf_layer_fields(config, path))


def lfm3_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of an Lfm3ForCausalLM config (LFM3-1.7B): LFM2's convolutions (7 taps
    by default), attention layers "full_attention" or "sliding_attention" (`sliding_window`,
    256), the sliding ones turning every angle on their base (10k), the full ones as
    `rope_parameters.full_attention` says ("proportional": half of each head's angles turn, on
    1M), a sigmoid gate per attention head (`use_attention_gate`) and sandwich norms, which
    every LFM3 has (`use_sandwich_norm`: False is refused). The MLP is intermediate_size wide,
    as it is."""
    if not config.get("use_sandwich_norm", True):
        raise ValueError(f"{path}: use_sandwich_norm=false is not supported for lfm3")
    kinds = config.get("layer_types")
    num_layers = int(config["num_hidden_layers"])
    if kinds is None:  # Lfm3Config's default order
        kinds = [
            "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
            for i in range(num_layers)
        ]
    allowed = {"conv", "sliding_attention", "full_attention"}
    if len(kinds) != num_layers or set(kinds) - allowed:
        raise ValueError(
            f"{path}: layer_types must name one of {sorted(allowed)} for each of the "
            f"{num_layers} layers, got {kinds!r}"
        )
    # an entry without a base takes the config's rope_theta, else Lfm3Config's 1M (as
    # transformers' standardize_rope_params fills it in)
    fallback = float(config.get("rope_theta") or 1_000_000.0)
    rope = config.get("rope_parameters") or _LFM3_ROPE
    global_rope, local_theta = rope_by_layer_type(rope, path)
    theta, scaling = full_attention_rope(global_rope["rope_parameters"], path, fallback)
    local = [kind == "sliding_attention" for kind in kinds]
    window = config.get("sliding_window", 256)
    if any(local) and not (isinstance(window, int) and window > 0):
        # without one the sliding layers would read the global layers' rope table
        raise ValueError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    return dict(
        intermediate_size=int(config["intermediate_size"]),
        sliding_windows=windows(local, window),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=fallback if local_theta is None else local_theta,
        attn_head_gate=bool(config.get("use_attention_gate", True)),
        **_hf_shared_fields(config, kinds, 7, path),
    )


def lfm2_moe_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of an Lfm2MoeForCausalLM config (LFM2-8B-A1B, LFM2-24B-A2B): LFM2's
    layers, the first `num_dense_layers` with a dense MLP of intermediate_size (as it is), the
    others sparse: each expert scored by its sigmoid, the top k chosen by score + expert_bias
    (use_expert_bias), renormalised (norm_topk_prob), scaled by routed_scaling_factor."""
    num_layers = int(config["num_hidden_layers"])
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not config.get(key):
            raise ValueError(f"{path}: an Lfm2MoeForCausalLM config needs {key!r}")
    return dict(
        intermediate_size=int(config["intermediate_size"]),
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        dense_layers=tuple(range(min(int(config.get("num_dense_layers", 2)), num_layers))),
        moe_selection_bias=bool(config.get("use_expert_bias", True)),
        moe_scoring="sigmoid",
        moe_norm_eps=1e-6,  # Lfm2MoeSparseMoeBlock's, in the renormalising sum
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        **_hf_layer_fields(config, path),
    )


def _hf_layer_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """What LFM2's configs say of their layers: which are convolutions (`layer_types`, or the
    older `full_attn_idxs`), then _hf_shared_fields'."""
    num_layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is None:
        attention = set(config.get("full_attn_idxs") or range(num_layers))
        kinds = ["full_attention" if i in attention else "conv" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"conv", "full_attention"}:
        raise ValueError(
            f"{path}: layer_types must name 'conv' or 'full_attention' for each of the "
            f"{num_layers} layers, got {kinds!r}"
        )
    return _hf_shared_fields(config, kinds, 3, path)


def _hf_shared_fields(
    config: dict[str, Any], kinds: list[str], taps: int, path: Path
) -> dict[str, Any]:
    """What LFM2's and LFM3's configs say alike: which layers are convolutions (`kinds`), their
    taps (`taps` where conv_L_cache is absent) and biases, the norms' epsilon, the tied head."""
    return dict(
        rms_norm_eps=float(config.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(
            config.get("tie_embedding", config.get("tie_word_embeddings", True))
        ),
        **_conv_fields(
            [i for i, kind in enumerate(kinds) if kind == "conv"],
            int(config.get("conv_L_cache", taps)),
            bool(config.get("conv_bias", False)),
            path,
        ),
    )


def lfm2_gguf_fields(
    meta: dict[str, Any], arch: str, num_layers: int, path: Path
) -> dict[str, Any]:
    """ModelArch fields of an lfm2 GGUF (`arch`: its general.architecture): its conv layers
    (head_count_kv 0) and their taps, the attention layers' KV heads."""
    kv_heads = meta.get(f"{arch}.attention.head_count_kv")
    if not isinstance(kv_heads, list) or len(kv_heads) != num_layers:
        raise ValueError(f"{path}: {arch}.attention.head_count_kv must list each layer's heads")
    attention = {int(n) for n in kv_heads if n}
    if len(attention) != 1:
        raise ValueError(f"{path}: {arch} attention layers with KV heads {sorted(attention)}")
    if f"{arch}.shortconv.l_cache" not in meta:
        raise ValueError(f"{path}: missing GGUF metadata {arch}.shortconv.l_cache")
    conv = [i for i, n in enumerate(kv_heads) if not n]
    fields = dict(
        num_key_value_heads=attention.pop(),
        **_conv_fields(conv, int(meta[f"{arch}.shortconv.l_cache"]), False, path),
    )
    if arch == "lfm2moe":  # llama.cpp requires the key there (and reads no weights scale)
        gating = meta.get(f"{arch}.expert_gating_func")
        if gating not in _GGUF_GATING:
            raise ValueError(
                f"{path}: {arch}.expert_gating_func must be 1 (softmax) or 2 (sigmoid), "
                f"got {gating!r}"
            )
        fields["moe_scoring"] = _GGUF_GATING[gating]
        fields["moe_norm_eps"] = 1e-6  # as the HF model's (lfm2_moe_hf_fields)
    return fields


def _conv_fields(conv: list[int], kernel: int, bias: bool, path: Path) -> dict[str, Any]:
    if kernel < 2:
        raise ValueError(f"{path}: a short convolution needs conv_L_cache >= 2, got {kernel}")
    return dict(recurrent_layers=tuple(conv), conv_kernel=kernel, conv_bias=bias)


def lfm2_names(
    weights: Iterator[tuple[str, Any]], sandwich: bool = False
) -> Iterator[tuple[str, Any]]:
    """An LFM2 checkpoint's tensors under the shared parts' names; `sandwich`: LFM3's, whose
    blocks norm after each sublayer too."""
    layer_names = {**_HF_LAYER_NAMES, **_HF_LFM3_LAYER_NAMES} if sandwich else _HF_LAYER_NAMES
    for name, tensor in weights:
        if name == "model.embedding_norm.weight":
            name = "model.norm.weight"
        elif name.endswith(".feed_forward.expert_bias"):
            name = name.replace(
                "feed_forward.expert_bias", "mlp.moe_statics.e_score_correction_bias"
            )
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, leaf = rest.rpartition(".")
            module = layer_names.get(module, module)
            if module.startswith("feed_forward."):  # the MLP's linears (an expert's)
                scope, _, linear = module.replace("feed_forward", "mlp", 1).rpartition(".")
                module = f"{scope}.{_HF_MLP_NAMES.get(linear, linear)}"
            name = f"model.layers.{layer}.{module}.{leaf}"
        yield name, tensor
