"""Quantized K/V (--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | q8_0): how a pool tensor holds them,
and the torch twin of the native conversions (model/native/kv_quant.h), bit for bit.

The pool tensor's dtype names its element type, so whoever holds a cache tensor (attention, the
connectors, a draft model's pool) knows it without another argument:

    kv_cache_dtype    tensor dtype           tensor shape                   one row: a token's K
                                                                            or V of one KV head
    float32/16, bf16  that dtype             [2, NB, bs, Hkv, D]            D elements
    fp8_e4m3          torch.float8_e4m3fn    [2, NB, bs, Hkv, D]            D e4m3fn bytes
    fp8_e5m2          torch.float8_e5m2      [2, NB, bs, Hkv, D]            D e5m2 bytes
    q8_0              torch.uint8            [2, NB, bs, Hkv, D / 32 * 34]  D / 32 block_q8_0s

A q8_0 row is D / 32 of llama.cpp's block_q8_0 end to end: block b is row[34 b : 34 b + 34],
an fp16 scale d (little-endian) then 32 int8 q, and value 32 b + i of the row is d * q[i]. So
a row is a valid GGUF Q8_0 row (gguf-py reads it). fp8 rows hold x / KV_SCALE.

fp8 per-tensor scales: K and V of every layer are stored as x / KV_SCALE with KV_SCALE = 1.0,
vLLM's k_scale / v_scale when a checkpoint carries none (and what it uses unless asked to
calculate them). Values past the type's largest finite one (448 for e4m3, 57344 for e5m2)
saturate to it; SmolLM2's K stay under ~25 and its V under ~10. The kernel takes other scales
(k_scale, v_scale; tests use them); nothing calibrates them here.
"""

from __future__ import annotations

import torch

from tokenbus.config import Q8_0_BLOCK_BYTES, Q8_0_BLOCK_VALUES

KV_SCALE = 1.0
KV_STORAGE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "q8_0": torch.uint8,
}
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The pool tensor's dtype for a resolved --kv-cache-dtype."""
    return KV_STORAGE_DTYPES[kv_cache_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype a pool tensor of `dtype` holds (the inverse of kv_storage_dtype)."""
    return next(name for name, stored in KV_STORAGE_DTYPES.items() if stored == dtype)


def tensor_scales(dtype: torch.dtype) -> tuple[float, float]:
    """(k_scale, v_scale) the kernels take for a pool of `dtype`: KV_SCALE for fp8, else 1."""
    return (KV_SCALE, KV_SCALE) if dtype in FP8_MAX else (1.0, 1.0)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """The last dimension of a pool tensor of `dtype` whose rows hold head_dim values."""
    if dtype != torch.uint8:
        return head_dim
    if head_dim % Q8_0_BLOCK_VALUES:
        raise ValueError(
            f"kv_cache_dtype q8_0 needs a head size that is a multiple of {Q8_0_BLOCK_VALUES}, "
            f"got {head_dim}"
        )
    return head_dim // Q8_0_BLOCK_VALUES * Q8_0_BLOCK_BYTES


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size of a pool tensor [2, NB, bs, Hkv, row]."""
    width = kv_cache.shape[-1]
    if kv_cache.dtype != torch.uint8:
        return width
    return width // Q8_0_BLOCK_BYTES * Q8_0_BLOCK_VALUES


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """x [..., D] (any float dtype) -> rows [..., row_width(dtype, D)] of `dtype`, rounded as
    kv_quant.h's kv_store_rows rounds them; fp8 stores x / scale (default KV_SCALE)."""
    if dtype == torch.uint8:
        return _quantize_q8_0(x.float())
    if dtype in FP8_MAX:
        scale = KV_SCALE if scale is None else scale
        x = x.float() if scale == 1.0 else x.float() * (1.0 / scale)
        return x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x.to(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """rows [..., W] of a pool's dtype -> [..., D] in `dtype` (exact: every stored value and
    each q8_0 product is an fp32 number); fp8 rows times scale (default KV_SCALE)."""
    if rows.dtype == torch.uint8:
        return _dequantize_q8_0(rows).to(dtype)
    if rows.dtype in FP8_MAX:
        scale = KV_SCALE if scale is None else scale
        x = rows.float()
        return (x if scale == 1.0 else x * scale).to(dtype)
    return rows.to(dtype)


def as_stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] rounded as a pool of kv_dtype would hold it, in x's dtype."""
    if kv_dtype == x.dtype:
        return x
    return dequantize(quantize(x, kv_dtype), x.dtype)


def write_rows(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """flat [num_slots, Hkv, W] (one half of a pool, K or V) [slots] = x [T, Hkv, D], rounded
    to the pool's type. 1-byte types go in as bytes: torch has no index_copy_ for fp8."""
    rows = quantize(x, flat.dtype)
    if flat.element_size() == 1:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def _quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., D] -> uint8 [..., D / 32 * 34], as llama.cpp's quantize_row_q8_0_ref: d =
    max |x| / 127 of each 32 values, q = round-half-away(x * (1 / d)), d stored as fp16."""
    *lead, head_dim = x.shape
    width = row_width(torch.uint8, head_dim)
    blocks = x.reshape(*lead, head_dim // Q8_0_BLOCK_VALUES, Q8_0_BLOCK_VALUES)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    scaled = blocks * inv
    whole = scaled.trunc()  # roundf: ties away from zero (torch.round goes to even)
    q = whole + torch.where((scaled - whole).abs() >= 0.5, scaled.sign(), torch.zeros_like(whole))
    out = torch.empty(*blocks.shape[:-1], Q8_0_BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :2] = d.to(torch.float16).view(torch.uint8)
    out[..., 2:] = q.to(torch.int8).view(torch.uint8)
    return out.view(*lead, width)


def _dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 32 * 34] -> fp32 [..., D]."""
    *lead, width = rows.shape
    blocks = rows.reshape(*lead, width // Q8_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [..., nb, 32]
    return (q * d).view(*lead, width // Q8_0_BLOCK_BYTES * Q8_0_BLOCK_VALUES)
