"""A GGUF's rotary metadata as our rope_scaling (L2): llama.cpp's rope.scaling.* keys (linear,
YaRN), its rope tensors (Llama 3's rope_freqs divisors, LongRoPE's two factor sets), and the
Llama 4 query temperature (Ministral 3's, Mistral 4's)."""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize

from tokenbus.loader.gguf_file import GGUFFile
from tokenbus.loader.minicpm3_config import MINICPM3_GGUF

_ROPE_FREQS = (
    "rope_freqs.weight"  # per-frequency divisors (Llama 3.1 rope); folded into rope_scaling
)
_ROPE_FACTORS = {  # LongRoPE's factor sets (phi3); folded into rope_scaling
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
ROPE_TENSORS = (_ROPE_FREQS, *_ROPE_FACTORS.values())


def gguf_rope_scaling(gf: GGUFFile, arch: str) -> dict | None:
    """The file's rope scaling as ModelArch.rope_scaling (None: plain rope): LongRoPE's factor
    tensors, Llama 3's rope_freqs divisors, or its rope.scaling.type (linear, yarn)."""
    kind = gf.metadata.get(f"{arch}.rope.scaling.type", "none")
    if any(name in gf.tensors for name in _ROPE_FACTORS.values()):
        return _longrope(gf, arch, kind)
    if _ROPE_FREQS in gf.tensors:
        if kind != "none":
            raise ValueError(f"{gf.path}: both {_ROPE_FREQS} and rope scaling type {kind!r}")
        factors = _floats(gf, gf.tensors[_ROPE_FREQS])
        return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gf.metadata[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":
        return _yarn(gf, arch)
    raise ValueError(
        f"{gf.path}: unsupported rope scaling type {kind!r} ({arch}.rope.scaling.type)"
    )


def attn_temperature(gf: GGUFFile, arch: str) -> tuple[float, int]:
    """llama.cpp's Llama 4 temperature (Ministral 3, Mistral 4): its scale, over the length it
    floors the positions by (`attention.temperature_length` where the file has one, as
    deepseek2's graph reads; else the YaRN's original context)."""
    length = gf.metadata.get(f"{arch}.attention.temperature_length") or gf.metadata.get(
        f"{arch}.rope.scaling.original_context_length"
    )
    if not length:
        raise ValueError(
            f"{gf.path}: {arch}.attention.temperature_scale needs "
            f"{arch}.rope.scaling.original_context_length"
        )
    return float(gf.metadata[f"{arch}.attention.temperature_scale"]), int(length)


def _yarn(gf: GGUFFile, arch: str) -> dict:
    """llama.cpp's YaRN keys as transformers' rope_parameters (convert_hf_to_gguf writes the
    config's attention_factor as yarn_attn_factor). Keys with no transformers counterpart are
    refused unless they hold llama.cpp's neutral value."""
    meta, key = gf.metadata, f"{arch}.rope.scaling."
    if float(meta.get(key + "yarn_ext_factor", 1.0)) != 1.0:
        raise ValueError(
            f"{gf.path}: {key}yarn_ext_factor={meta[key + 'yarn_ext_factor']} is not supported "
            "(only 1.0)"
        )
    for name in ("factor", "original_context_length"):
        if key + name not in meta:
            raise ValueError(f"{gf.path}: rope scaling type 'yarn' needs {key}{name}")
    scaling = {
        "rope_type": "yarn",
        "factor": float(meta[key + "factor"]),
        "original_max_position_embeddings": int(meta[key + "original_context_length"]),
    }
    for name, hf_name in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if key + name in meta:
            scaling[hf_name] = float(meta[key + name])
    log_mul = float(meta.get(key + "yarn_log_multiplier", 0.0))
    if log_mul:  # llama.cpp: mscale 1 and mscale_all_dim this; it replaces an attention factor
        scaling.pop("attention_factor", None)
        scaling.update(mscale=1.0, mscale_all_dim=log_mul)
    return scaling


def _longrope(gf: GGUFFile, arch: str, kind: str) -> dict:
    """Phi-3's LongRoPE from its two factor tensors (older converters write no scaling type;
    newer ones "longrope"); the model picks the set for its context (model/layers/rotary.py)."""
    meta, key = gf.metadata, f"{arch}.rope.scaling."
    if kind not in ("none", "longrope"):
        raise ValueError(f"{gf.path}: rope factor tensors with rope scaling type {kind!r}")
    present = [name for name in ROPE_TENSORS if name in gf.tensors]
    if sorted(present) != sorted(_ROPE_FACTORS.values()):
        raise ValueError(
            f"{gf.path}: LongRoPE needs both {' and '.join(_ROPE_FACTORS.values())} (and no "
            f"{_ROPE_FREQS}); found {', '.join(present)}"
        )
    # MiniCPM3's converter writes none: llama.cpp's training context stands in
    trained = meta[f"{arch}.context_length"] if arch == MINICPM3_GGUF else None
    original = meta.get(key + "original_context_length", trained)
    if original is None:
        raise ValueError(f"{gf.path}: LongRoPE needs {key}original_context_length")
    original = int(original)
    scaling = {
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "factor": meta[f"{arch}.context_length"] / original,
        **{
            hf_name: tuple(float(f) for f in _floats(gf, gf.tensors[name]))
            for hf_name, name in _ROPE_FACTORS.items()
        },
    }
    if key + "attn_factor" in meta:
        scaling["attention_factor"] = float(meta[key + "attn_factor"])
    return scaling


def _floats(gf: GGUFFile, info) -> np.ndarray:
    """A rope tensor's values as fp32 (arch_from_gguf has checked every tensor's type)."""
    return dequantize(gf.tensor_bytes(info), info.qtype)
