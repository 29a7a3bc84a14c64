"""Rotary position embedding (HF's rotate-half layout) with a precomputed cos/sin table.

Supported `rope_scaling` types: None/"default", "linear", "llama3" (Llama 3.1/3.2),
"freq_factors" (a GGUF's `rope_freqs` tensor: llama.cpp divides each frequency by its factor),
"yarn" (Qwen2.5/Qwen3 long-context configs) and "longrope" (Phi-3/Phi-4). The table is built in
fp32 exactly as HF builds its angles (position * inv_freq in fp32, then cos/sin times the
attention factor), so fp32 results match HF bit for bit; lookups cast to the activation dtype
once per step.

Partial rotary (`rotary_dim` < head_dim: Phi-4-mini turns the first 3/4 of each head): the
table has rotary_dim / 2 columns and `apply_rotary` turns the first rotary_dim values of each
head, passing the rest through, as HF's Phi3 does.

LongRoPE has two factor sets, and HF picks one per forward from the longest position in it
(long past `original_max_position_embeddings`). An engine that caches K/V must not switch sets
in the middle of a sequence, so the set is fixed per engine from the longest sequence it admits,
the table's length (`max_position`: the engine's max_model_len, worker/model_builder.py): long
when it exceeds the original context, short otherwise. This is vLLM's and llama.cpp's rule, and
it is HF's for every sequence longer than the original context (long) and, for an engine capped
at the original context, for every sequence (short).
"""

from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "proportional", "yarn", "longrope")


def rope_type_of(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency smoothing (same arithmetic as transformers'
    _compute_llama3_parameters)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters: inv_freq blended between interpolation (scaled
    by `factor`) and extrapolation over a linear ramp of dims, and the attention factor."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_share = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share
    return inv_freq, float(attention_factor)


def _longrope(
    dim: int, base: float, scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """transformers' _compute_longrope_parameters, the factor set chosen for the engine's
    context (this module's docstring); `factor` (config max / original positions, filled in by
    the loader) sets the attention factor unless the config gives one."""
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling["factor"]
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    key = "long_factor" if max_position > original else "short_factor"
    ext_factors = torch.tensor(scaling[key], dtype=torch.float32)
    if ext_factors.shape != (dim // 2,):
        raise ValueError(
            f"rope_scaling.{key}: expected {dim // 2} values (rotary dims / 2), "
            f"got {ext_factors.numel()}"
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**exponents), float(attention_factor)


def compute_rope(
    dim: int, base: float, scaling: dict | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """[dim // 2] fp32 inverse frequencies for `dim` rotary dims, and the factor cos/sin are
    multiplied by (1 but for yarn and longrope)."""
    rope_type = rope_type_of(scaling)
    if rope_type == "yarn":
        return _yarn(dim, base, scaling)
    if rope_type == "longrope":
        return _longrope(dim, base, scaling, max_position)
    return compute_inv_freq(dim, base, scaling), 1.0


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies of the types without an attention factor."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "proportional":
        # Gemma 4's global layers: only the first partial_rotary_factor of the angles turn (the
        # others' frequency 0: cos 1, sin 0), their exponents over the WHOLE head, and every
        # dim stays in the rotate-half pairs (i, i + D/2), unlike a partial rotary_dim
        turned = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turned:] = 0.0
        return inv_freq / scaling.get("factor", 1.0)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r} (supported: {ROPE_TYPES})")


class RotaryEmbedding(nn.Module):
    """cos/sin rows for positions [0, max_position), over the first `rotary_dim` dims of each
    head (None: all of them)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(
                f"rotary_dim: expected an even number <= head_dim {head_dim}, got {rotary_dim}"
            )
        inv_freq, attention_factor = compute_rope(self.rotary_dim, base, scaling, max_position)
        self.attention_factor = attention_factor
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, R/2]
        self.register_buffer("cos_table", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_table", angles.sin() * attention_factor, persistent=False)

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [T, 1, R/2] (broadcast over heads), in `dtype`."""
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by angles cos/sin [T, 1, R/2]: the halves (x1, x2) of the first R dims
    -> (x1c - x2s, x2c + x1s); dims past R (partial rotary) pass through."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
