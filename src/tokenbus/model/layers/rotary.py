"""Rotary position embedding (HF's rotate-half layout) with a precomputed cos/sin table.

Supported `rope_scaling` types: None/"default", "linear", "llama3" (Llama 3.1/3.2) and
"freq_factors" (a GGUF's `rope_freqs` tensor: llama.cpp divides each frequency by its factor).
The table is built in fp32 exactly as HF builds its angles (position * inv_freq in fp32),
so fp32 results match HF bit for bit; lookups cast to the activation dtype once per step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


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


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r} (supported: {ROPE_TYPES})")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [T, 1, D/2] (broadcast over heads), in `dtype`."""
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by angles cos/sin [T, 1, D/2]: the halves (x1, x2) ->
    (x1c - x2s, x2c + x1s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
