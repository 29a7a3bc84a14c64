"""Gemma, Gemma 2 and Gemma 3 (text) shapes: what their config.json or GGUF metadata says beyond
a Llama decoder's (L2). Each reader returns ModelArch fields; hf_loader / gguf_loader join them.
Gemma (1) has no local layers, no soft-caps and Llama's two norms a layer.

- Layer windows: HF's `layer_types` where the config has it, else Gemma 2's alternation (even
  layers local) or Gemma 3's `sliding_window_pattern` (default 6: five local, then a global
  one); a GGUF has llama.cpp's fixed patterns (2 and 6) unless it stores
  `{arch}.attention.sliding_window_pattern`.
- RoPE: Gemma 3's global layers take `rope_theta` and `rope_scaling`, its local ones
  `rope_local_base_freq` unscaled (transformers 5 writes both under `rope_parameters`, keyed by
  layer type).
- Attention scale: `query_pre_attn_scalar ** -0.5`. A GGUF does not store it; llama.cpp takes
  head_dim, or hidden_size / heads for the 27B models (46 layers for Gemma 2, 62 for Gemma 3).
- llama.cpp's converter stores every Gemma RMSNorm weight as (1 + w): gguf_loader undoes that
  (GEMMA_GGUF_ARCHITECTURES) so every source yields HF's w.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenbus.loader.layer_kinds import (
    gguf_local_layers,
    hf_local_layers,
    rope_by_layer_type,
    windows,
)

GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
GEMMA_GGUF_ARCHITECTURES = GEMMA_ARCHITECTURES
# Four norms a layer (before and after attention and MLP), under Gemma 2's GGUF names.
SANDWICH_GGUF_ARCHITECTURES = ("gemma2", "gemma3")
GEMMA_ACTIVATION = "gelu_pytorch_tanh"  # HF's tanh-approximated GELU (GeGLU MLP)
# every Nth layer is global, the others local (Gemma's 1: every layer global)
_DEFAULT_PATTERN = {"gemma": 1, "gemma2": 2, "gemma3": 6}
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales those by hidden / heads
_GGUF_LOCAL_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3


def gemma_hf_fields(config: dict[str, Any], path: Path, architecture: str) -> dict[str, Any]:
    """ModelArch fields of a Gemma config.json (both transformers layouts)."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise ValueError(
            f"{path}: hidden_activation {activation!r} is not supported "
            f"(Gemma's GeGLU: {GEMMA_ACTIVATION!r})"
        )
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention=true is not supported")
    num_layers = int(config["num_hidden_layers"])
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return dict(
        hidden_act=GEMMA_ACTIVATION,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or head_dim),
        attn_logit_softcapping=_optional_float(config.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(config.get("final_logit_softcapping")),
        sliding_windows=_hf_windows(config, path, architecture, num_layers),
    )


def gemma3_hf_rope(config: dict[str, Any], path: Path) -> tuple[dict[str, Any], float]:
    """(a flat rope config for the global layers, the local layers' base) of a Gemma 3
    config.json; the local layers' rope must be the default one."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5
        flat, theta = rope_by_layer_type(params, path)
        return flat, theta or float(config.get("rope_local_base_freq", 10000.0))
    flat = {key: config[key] for key in ("rope_theta", "rope_scaling") if key in config}
    flat.setdefault("rope_theta", 1_000_000.0)  # Gemma3TextConfig's global default
    return flat, float(config.get("rope_local_base_freq", 10000.0))


def gemma_gguf_fields(meta: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """ModelArch fields of a Gemma GGUF (llama.cpp's keys and fixed choices)."""
    hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    scalar = hidden // heads if num_layers == _GGUF_27B_LAYERS.get(arch) else head_dim
    window = meta.get(f"{arch}.attention.sliding_window")
    local = gguf_local_layers(meta, arch, num_layers, _DEFAULT_PATTERN[arch])
    return dict(
        hidden_act=GEMMA_ACTIVATION,
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=_optional_float(meta.get(f"{arch}.attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(meta.get(f"{arch}.final_logit_softcapping")),
        sliding_windows=windows(local, window),
        rope_local_theta=_GGUF_LOCAL_THETA if arch == "gemma3" else None,
    )


def _hf_windows(
    config: dict[str, Any], path: Path, architecture: str, num_layers: int
) -> tuple[int | None, ...]:
    pattern = int(
        config.get("sliding_window_pattern")
        or config.get("_sliding_window_pattern")
        or _DEFAULT_PATTERN[architecture]
    )
    local = hf_local_layers(config, path, num_layers, pattern)
    return windows(local, config.get("sliding_window"))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
