"""Quantized K/V (--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | q8_0): the native row conversions
(model/native/kv_quant.h) against their torch twin (model/kv_quant.py) and gguf-py, bit for bit;
the attention kernel reading quantized caches in place against the torch path, which
dequantizes the blocks it gathers, on every vector tier this CPU builds (AVX-512, AVX2, plain
x86-64); and the pool's real bytes."""

from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest
import torch
from tests.model.test_native_attention import DECODES, make_batch

from tokenbus.model import kv_quant
from tokenbus.model.attention import build_attention_plan, paged_attention
from tokenbus.model.native import KERNEL_DTYPES, load_paged_attention
from tokenbus.model_arch import ModelArch
from tokenbus.utils.cpu import CpuFeatures, _capped
from tokenbus.worker.kv_cache import allocate_kv_caches, bytes_per_block

QUANTIZED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]  # uint8: q8_0
LONG = [(1, 40), (1, 7), (40, 0), (33, 60), (70, 5)]  # two decodes, then flash-path chunks


@pytest.fixture(scope="module", params=["native", "avx2", "baseline"])
def tier(request):
    """The kernel built for this CPU, and capped to x86-64-v3 (AVX2 + FMA + F16C) and plain
    x86-64, where this CPU runs them: each has its own conversion code (16 lanes, 8, scalar)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    detected = CpuFeatures.detect()
    if request.param == "native":
        return load_paged_attention()
    if not detected.is_x86:
        pytest.skip("the capped builds are x86-64 levels")
    if request.param == "avx2" and detected.isa not in ("avx2", "avx512"):
        pytest.skip(f"an AVX2 build needs AVX2 + FMA + F16C; this CPU is {detected.describe()}")
    cap = request.param
    return load_paged_attention(CpuFeatures(_capped(detected.flags, cap), cap))


def _values(rows: int = 512, head_dim: int = 64) -> torch.Tensor:
    """fp32 [rows, head_dim] over 2^-24 .. 2^12, with the cases rounding decides: zeros, fp8
    subnormals and ties, values past fp8's largest, and q8_0 blocks whose x / d land on .5."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-24, 12, rows, base=2).unsqueeze(1)
    x = torch.randn(rows, head_dim, generator=g) * magnitudes
    x[0] = 0.0
    x[1, :8] = torch.tensor([448.0, 464.0, 480.0, -1e6, 57344.0, 61440.0, 2**-9 * 1.5, -(2**-16)])
    x[2, :8] = torch.tensor([1.0625, 1.1875, 2**-7 * 3, 2**-10, 3e-3, -5e-3, 0.3125, 0.4375])
    x[3, :32] = torch.arange(32) - 15.5  # d = 16 / 127: several quants land on ties
    x[4, :32] = 127.0 * torch.arange(32) / 31.0 + 0.5 * (127.0 / 31.0)
    return x


def _c_quantize(kernel, x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    rows, head_dim = x.shape
    out = torch.empty(rows, kv_quant.row_width(dtype, head_dim), dtype=dtype)
    status = kernel.quantize_fn(
        out.data_ptr(),
        x.data_ptr(),
        rows,
        head_dim,
        KERNEL_DTYPES[dtype],
        ctypes.c_float(1 / scale),
    )
    return status, out


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_native_rows_equal_the_torch_twin_bit_for_bit(tier, dtype):
    x = _values()
    want = kv_quant.quantize(x, dtype)
    status, got = _c_quantize(tier, x, dtype)
    if status == 4:  # a build without F16C does not write q8_0 (its scales are fp16)
        assert dtype == torch.uint8
    else:
        assert status == 0
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    read = torch.empty_like(x)
    assert (
        tier.dequantize_fn(want.data_ptr(), x.shape[0], 64, KERNEL_DTYPES[dtype], read.data_ptr())
        == 0
    )
    assert torch.equal(read, kv_quant.dequantize(want, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounds_as_torch_casts_and_saturates(dtype):
    x = _values()
    scale = 0.25
    stored = kv_quant.quantize(x, dtype, scale)
    limit = kv_quant.FP8_MAX[dtype]
    assert torch.equal(stored, (x / scale).clamp(-limit, limit).to(dtype))
    back = kv_quant.dequantize(stored, torch.float32, scale)
    assert back.isfinite().all() and back.abs().max() == limit * scale  # saturated, never NaN
    # 3 (e4m3) or 2 (e5m2) mantissa bits: half an ulp relative, in the normal range
    normal = (x.abs() / scale > 2**-6) & (x.abs() / scale < limit)
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= (2**-4 if dtype == torch.float8_e4m3fn else 2**-3) + 1e-7


def test_q8_0_rows_are_gguf_q8_0_blocks():
    """A q8_0 row is llama.cpp's block_q8_0 layout: gguf-py quantizes and reads it the same."""
    gguf = pytest.importorskip("gguf")
    x = _values()
    ours = kv_quant.quantize(x, torch.uint8)
    assert ours.shape == (x.shape[0], 68)
    assert np.array_equal(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0), ours)
    theirs = gguf.quants.dequantize(ours.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(theirs.reshape(x.shape), kv_quant.dequantize(ours, torch.float32))
    # where d is a normal fp16, the error is at most half a step, plus d's own rounding
    d = ours.view(-1, 2, 34)[..., :2].contiguous().view(torch.float16).float()
    blocks = x.view(-1, 2, 32)
    err = (kv_quant.dequantize(ours, torch.float32).view(-1, 2, 32) - blocks).abs()
    bound = d * 0.5 + blocks.abs().amax(-1, keepdim=True) * 2**-11
    assert (err <= bound)[(d >= 2**-14).expand_as(err)].all()


def _both_paths(kernel, requests, dtype, num_heads=9, num_kv_heads=3, head_dim=64, **kwargs):
    """The native kernel and the torch path over the same quantized cache and step."""
    q, k, v, kv, ctx = make_batch(requests, num_heads, num_kv_heads, head_dim, **kwargs)
    kv = kv_quant.quantize(kv * 4, dtype)  # |K|, |V| up to ~20, as SmolLM2's
    ctx.kv_caches = [kv]
    scale = head_dim**-0.5
    ref = paged_attention(
        q, k, v, kv.clone(), ctx.slot_mapping, build_attention_plan(ctx, torch.float32), scale
    )
    plan = build_attention_plan(ctx, torch.float32, kernel)
    out = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, scale)
    return out, ref, plan


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_decodes_read_quantized_blocks_in_place(tier, dtype, block_size):
    """Decodes and a 5-query verification; the only difference to the torch path is the
    order of the fp32 sums (both read the same values: dequantizing is exact)."""
    out, ref, plan = _both_paths(tier, DECODES + [(5, 30)], dtype, block_size=block_size)
    assert plan.native is not None and not plan.decode_tiles
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 128), (6, 2, 96)])
def test_long_queries_read_quantized_blocks_in_place(tier, dtype, heads):
    """Prefill chunks by the flash path where the build has one (not plain x86-64), else SDPA
    over dequantized blocks; head sizes 64, 128 and one the kernel does not specialise."""
    out, ref, plan = _both_paths(tier, LONG, dtype, *heads)
    assert (plan.native_long is not None) == tier.takes_long_queries(torch.float32, dtype, heads[2])
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("long_queries", [False, True])
def test_per_tensor_scales(tier, dtype, long_queries):
    """k_scale and v_scale other than 1: the kernel over K / k_scale and V / v_scale in fp8
    equals the torch path over the same cache dequantized (this step's K/V stored first)."""
    if long_queries and not tier.takes_long_queries(torch.float32, dtype, 64):
        pytest.skip("this build has no flash path")
    requests = LONG if long_queries else DECODES
    q, k, v, kv, ctx = make_batch(requests, 9, 3, 64)
    scales = (0.05, 0.02)  # K, V
    stored = torch.stack([kv_quant.quantize(kv[i] * 4, dtype, scales[i]) for i in (0, 1)])
    flat = stored.view(2, -1, 3, 64)  # [2, slots, Hkv, D]
    for i, x in enumerate((k, v)):
        flat[i, ctx.slot_mapping] = kv_quant.quantize(x, dtype, scales[i])
    reference = torch.stack(
        [kv_quant.dequantize(stored[i], torch.float32, scales[i]) for i in (0, 1)]
    )
    as_stored = [reference.view(2, -1, 3, 64)[i, ctx.slot_mapping] for i in (0, 1)]
    ctx.kv_caches = [reference]
    scale = 0.125
    want = paged_attention(
        q, *as_stored, reference, ctx.slot_mapping, build_attention_plan(ctx, torch.float32), scale
    )
    reqs = [r for r, (q_len, _) in enumerate(requests) if (q_len > 16) == long_queries]
    got = torch.zeros_like(q)
    tier(
        q,
        stored,
        ctx.block_tables,
        torch.tensor(ctx.query_start_loc),
        ctx.seq_lens_t,
        torch.tensor(reqs),
        scale,
        got,
        long_queries,
        *scales,
    )
    rows = torch.cat(
        [torch.arange(ctx.query_start_loc[r], ctx.query_start_loc[r + 1]) for r in reqs]
    )
    torch.testing.assert_close(got[rows], want[rows], atol=3e-5, rtol=1e-4)


def test_q8_0_needs_whole_blocks_per_head():
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_quant.row_width(torch.uint8, 40)


def test_pool_holds_about_twice_the_tokens_of_float16():
    """Block bytes are the real bytes: fp8 1 a value (2x fp16's tokens in the same memory),
    q8_0 34 per 32 values (64 / 34 = 1.88x)."""
    arch = ModelArch("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192)  # SmolLM2-135M
    fp16 = bytes_per_block(arch, 16, torch.float16)
    assert fp16 / bytes_per_block(arch, 16, torch.float8_e4m3fn) == 2.0
    assert fp16 / bytes_per_block(arch, 16, torch.float8_e5m2) == 2.0
    assert fp16 / bytes_per_block(arch, 16, torch.uint8) == pytest.approx(64 / 34)
    for dtype in QUANTIZED:
        (cache, *_) = allocate_kv_caches(arch, 5, 16, dtype, torch.device("cpu"))
        assert cache.dtype == dtype and kv_quant.head_dim_of(cache) == 64
        assert cache.numel() * cache.element_size() * 30 == 5 * bytes_per_block(arch, 16, dtype)


def test_kv_cache_dtype_flag_and_resolution():
    """vLLM's "fp8" is fp8_e4m3; quantized K/V run on CPU, with the native or torch attention,
    and fp8 with the Triton kernels too (q8_0 is not read there); --help names every choice."""
    import argparse

    from tokenbus.cli.args import add_engine_args
    from tokenbus.engine.setup import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("fp8", "cpu", "float32", "gguf", "native") == "fp8_e4m3"
    assert resolve_kv_cache_dtype("q8_0", "cpu", "bfloat16", "none", "torch") == "q8_0"
    with pytest.raises(ValueError, match="runs on CPU"):
        resolve_kv_cache_dtype("q8_0", "cuda", "bfloat16", "none", "torch")
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        resolve_kv_cache_dtype("q8_0", "cpu", "float32", "none", "triton")
    with pytest.raises(ValueError, match="fp8 with the Triton kernels too.*'torch'"):
        resolve_kv_cache_dtype("fp8", "cuda", "bfloat16", "none", "torch")
    assert resolve_kv_cache_dtype("fp8", "cuda", "bfloat16", "none", "triton") == "fp8_e4m3"
    assert resolve_kv_cache_dtype("fp8_e5m2", "cpu", "float32", "none", "triton") == "fp8_e5m2"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = parser.format_help()
    assert "fp8_e4m3" in text and "fp8_e5m2" in text and "q8_0" in text
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
