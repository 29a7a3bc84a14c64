"""Gemma 3n (text) shapes: what its config.json or llama.cpp's gemma3n GGUF says beyond Gemma 3's
(L2). Each reader returns ModelArch fields; hf_loader / gguf_loader join them (model/gemma3n.py
says what each does).

- KV sharing: the last num_kv_shared_layers layers read the K/V of the last earlier layer of
  their kind (HF's kv_sharing_modes); llama.cpp stores the count
  (`gemma3n.attention.shared_kv_layers`).
- Activation sparsity: HF gives each layer's target sparsity (default 0.95 on the first 10 of
  more than 10 layers), llama.cpp the normal quantile it means (`activation_sparsity_scale`,
  -inf for 0); both become the std multiplier of ModelArch.activation_sparsity_std.
- The MLP width may be given per layer (a list): it must be one width here.
- llama.cpp's converter writes Gemma 3n's norms as they are (w: its norm_shift is 0), stacks the
  three AltUp projections (and the three unembedding ones) into one [3, H, H] tensor each, and
  pads the per-layer embedding table to the full vocabulary with zero rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

from tokenbus.loader.gemma_config import GEMMA_ACTIVATION, gemma3_hf_rope
from tokenbus.loader.layer_kinds import gguf_local_layers, hf_local_layers, windows

GEMMA3N_GGUF = "gemma3n"
_DEFAULT_SPARSE_LAYERS, _DEFAULT_SPARSITY = 10, 0.95  # Gemma3nTextConfig's
_PATTERN = 5  # four local layers, then a global one (HF's and llama.cpp's default)
_GGUF_LOCAL_THETA = 10000.0
# llama.cpp's global tensors -> HF names; its stacked ones -> the HF module list they split into
GEMMA3N_GGUF_GLOBAL_NAMES = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
GEMMA3N_GGUF_STACKED = {
    "altup_proj.weight": "model.altup_projections",
    "altup_unembd_proj.weight": "model.altup_unembed_projections",
}
GEMMA3N_GGUF_BLOCK_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>, beside Gemma's norms
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "altup_correct_coef": "altup.correction_coefs",
    "altup_correct_scale": "altup.correct_output_scale",
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
}
GEMMA3N_PARAMETER_NAMES = ("altup.correct_output_scale",)


def gemma3n_hf_fields(config: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelArch fields, a flat rope config of the global layers) of a Gemma 3n config.json."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise ValueError(f"{path}: hidden_activation {activation!r} is not supported for gemma3n")
    if config.get("altup_active_idx", 0) != 0:
        raise ValueError(f"{path}: altup_active_idx must be 0, got {config['altup_active_idx']}")
    num_layers = int(config["num_hidden_layers"])
    local = hf_local_layers(config, path, num_layers, _PATTERN)
    sparsity = config.get("activation_sparsity_pattern")
    if sparsity is None:
        sparse = _DEFAULT_SPARSE_LAYERS if num_layers > _DEFAULT_SPARSE_LAYERS else 0
        sparsity = [_DEFAULT_SPARSITY] * sparse + [0.0] * (num_layers - sparse)
    if len(sparsity) != num_layers:
        raise ValueError(f"{path}: activation_sparsity_pattern needs {num_layers} values")
    rope, local_theta = gemma3_hf_rope(config, path)
    fields = dict(
        hidden_act=GEMMA_ACTIVATION,
        intermediate_size=_one_width(config["intermediate_size"], num_layers, path),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        sliding_windows=windows(local, config.get("sliding_window")),
        rope_local_theta=local_theta,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        kv_shared_layers=kv_shared_layers(local, int(config.get("num_kv_shared_layers", 0))),
        activation_sparsity_std=tuple(_std_multiplier(float(s)) for s in sparsity),
        **_stream_fields(config),
    )
    return fields, rope


def gemma3n_gguf_fields(
    meta: dict[str, Any], tensors: dict[str, Any], path: Path
) -> dict[str, Any]:
    """ModelArch fields of llama.cpp's gemma3n GGUF."""
    arch = GEMMA3N_GGUF
    num_layers = int(meta[f"{arch}.block_count"])
    if int(meta.get(f"{arch}.altup.active_idx", 0)) != 0:
        raise ValueError(f"{path}: {arch}.altup.active_idx must be 0")
    local = gguf_local_layers(meta, arch, num_layers, _PATTERN)
    scales = meta.get(f"{arch}.activation_sparsity_scale") or [-math.inf] * num_layers
    table = tensors["per_layer_token_embd.weight"].shape[0]
    return dict(
        hidden_act=GEMMA_ACTIVATION,
        intermediate_size=_one_width(meta[f"{arch}.feed_forward_length"], num_layers, path),
        final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
        sliding_windows=windows(local, meta.get(f"{arch}.attention.sliding_window")),
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", _GGUF_LOCAL_THETA)),
        kv_shared_layers=kv_shared_layers(
            local, int(meta.get(f"{arch}.attention.shared_kv_layers", 0))
        ),
        activation_sparsity_std=tuple(None if math.isinf(s) else float(s) for s in scales),
        per_layer_input_size=int(meta[f"{arch}.embedding_length_per_layer_input"]),
        per_layer_vocab_size=table,  # padded with zero rows past HF's 262144
        altup_inputs=int(meta.get(f"{arch}.altup.num_inputs", 4)),
        laurel_rank=tensors["blk.0.laurel_l.weight"].shape[0],
    )


def _stream_fields(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        per_layer_input_size=int(config.get("hidden_size_per_layer_input", 256)),
        per_layer_vocab_size=int(config.get("vocab_size_per_layer_input", 262_144)),
        altup_inputs=int(config.get("altup_num_inputs", 4)),
        altup_correct_scale=bool(config.get("altup_correct_scale", True)),
        laurel_rank=int(config.get("laurel_rank", 64)),
    )


def kv_shared_layers(local: list[bool], count: int) -> tuple[tuple[int, int], ...]:
    """(layer, owner) for the last `count` layers: each reads the last earlier layer of its kind
    (local or global) before them (HF's kv_sharing_modes)."""
    first = len(local) - count
    owners = {}
    for layer in range(first, len(local)):
        kind = local[layer]
        earlier = [i for i in range(first) if local[i] == kind]
        if not earlier:
            name = "local" if kind else "global"
            raise ValueError(
                f"num_kv_shared_layers {count}: layer {layer} has no earlier {name} layer"
            )
        owners[layer] = earlier[-1]
    return tuple(owners.items())


def _std_multiplier(sparsity: float) -> float | None:
    """The normal quantile of `sparsity` (0: None, no sparsity), rounded to fp32 as HF's icdf."""
    if sparsity <= 0.0:
        return None
    import struct

    quantile = NormalDist().inv_cdf(sparsity)
    return struct.unpack("f", struct.pack("f", quantile))[0]


def _one_width(width: Any, num_layers: int, path: Path) -> int:
    widths = width if isinstance(width, (list, tuple)) else [width] * num_layers
    if len(set(widths)) != 1:
        raise ValueError(
            f"{path}: an MLP width per layer ({sorted(set(widths))}) is not supported for gemma3n"
        )
    return int(widths[0])
