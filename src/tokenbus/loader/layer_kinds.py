"""Local (sliding-window) and global layers, as config.json and GGUF metadata say which is
which, and the RoPE each kind takes (L2; no torch). Gemma 2/3 and OLMo 3 read them here.

- HF: `layer_types` names each layer "sliding_attention" or "full_attention"; without it, a
  family's pattern: every Nth layer global, the others local (HF's `bool((i + 1) % N)`).
- GGUF: `{arch}.attention.sliding_window_pattern`, one flag per layer (true: local) or the
  pattern N; absent, the family's N (llama.cpp's `set_swa_pattern`, which agrees with HF's).
- RoPE per kind: transformers 5 writes `rope_parameters` keyed by layer type; the local
  layers' entry must be the default (unscaled) rope, its base theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")
# OLMo 3 (Olmo3Config's defaults, llama.cpp's too): a window of 4096 on all layers but every
# fourth; RoPE base 500k.
OLMO3_WINDOW, OLMO3_PATTERN, OLMO3_ROPE_THETA = 4096, 4, 500000.0
EXAONE4_PATTERN = 4  # Exaone4Config's default sliding_window_pattern: every fourth layer global


def is_local(layer: int, pattern: int) -> bool:
    """HF's `bool((i + 1) % pattern)`; llama.cpp's set_swa_pattern agrees."""
    return bool((layer + 1) % pattern)


def hf_local_layers(
    config: dict[str, Any], path: Path, num_layers: int, pattern: int
) -> list[bool]:
    """Which layers are local: config.json's `layer_types`, else every `pattern`-th global."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return [is_local(i, pattern) for i in range(num_layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(
            f"{path}: layer_types must name each of the {num_layers} layers as one of "
            f"{LAYER_TYPES}; got {layer_types!r}"
        )
    return [kind == "sliding_attention" for kind in layer_types]


def gguf_local_layers(meta: dict[str, Any], arch: str, num_layers: int, pattern: int) -> list[bool]:
    """Which layers are local: `{arch}.attention.sliding_window_pattern` (flags or N), else
    every `pattern`-th global."""
    stored = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
    if not isinstance(stored, (list, tuple)):
        return [is_local(i, int(stored)) for i in range(num_layers)]
    if len(stored) != num_layers:  # llama.cpp's per-layer flags: true = local
        raise ValueError(
            f"{arch}.attention.sliding_window_pattern: {len(stored)} flags for {num_layers} layers"
        )
    return [bool(flag) for flag in stored]


def windows(local: list[bool], window: int | None) -> tuple[int | None, ...]:
    """ModelArch.sliding_windows: `window` on the local layers, None on the others; () where no
    layer slides."""
    if not window or not any(local):
        return ()
    return tuple(int(window) if flag else None for flag in local)


def rope_by_layer_type(params: dict[str, Any], path: Path) -> tuple[dict[str, Any], float | None]:
    """(a flat rope config for the global layers, the local layers' base or None where their
    entry has none) from transformers 5's `rope_parameters` keyed by layer type."""
    if not isinstance(params.get("full_attention"), dict):
        raise ValueError(f"{path}: rope_parameters must have an entry for full_attention")
    local = dict(params.get("sliding_attention") or {})
    local_type = local.get("rope_type") or local.get("type") or "default"
    if local_type != "default":
        raise ValueError(
            f"{path}: rope_parameters.sliding_attention: rope type {local_type!r} is not "
            "supported (local layers take the default rope)"
        )
    theta = local.get("rope_theta")
    return {"rope_parameters": params["full_attention"] or {}}, (
        None if theta is None else float(theta)
    )


def full_attention_rope(
    full: dict[str, Any], path: Path, default_theta: float
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) of the global layers' `rope_parameters.full_attention`
    entry (Gemma 4's, LFM3's): the default rope or the "proportional" one, its
    partial_rotary_factor kept in rope_scaling (model/layers/rotary.py turns the first part of
    the angles over the whole head)."""
    full = dict(full)
    rope_type = full.pop("rope_type", None) or "default"
    if rope_type not in ("default", "proportional"):
        raise ValueError(
            f"{path}: rope_parameters.full_attention: rope type {rope_type!r} is not supported"
        )
    theta = float(full.pop("rope_theta", default_theta))
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **full}


def global_nope_layers(local: list[bool]) -> tuple[int, ...]:
    """ModelArch.nope_layers of a family whose global layers turn no rotary where its local ones
    slide (Cohere2's, EXAONE 4's); () where no layer slides."""
    if not any(local):
        return ()
    return tuple(i for i, is_local in enumerate(local) if not is_local)
