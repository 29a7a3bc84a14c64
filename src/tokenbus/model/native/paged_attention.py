"""Paged attention over K/V read in place (paged_attention.c), through ctypes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbus.model.kv_quant import QUANTIZED_KV_DTYPES
from tokenbus.model.native.build import load_library
from tokenbus.model.native.signatures import bind
from tokenbus.model.sdpa import check_sinks
from tokenbus.utils.cpu import CpuFeatures

_SOURCE = Path(__file__).with_name("paged_attention.c")

# Element-type codes of kv_quant.h, ELEM_F32 = 0 .. ELEM_Q8_0 = 5 (the cache tensor's dtype names
# its type: uint8 is q8_0, model/kv_quant.py), and the KV cache dtypes the kernel reads under each
# activation dtype (fp16, fp8 or q8_0 K/V under fp32 queries: a half or a quarter of the bytes).
_ELEMS = (torch.float32, torch.bfloat16, torch.float16, *QUANTIZED_KV_DTYPES)
KERNEL_DTYPES = {dtype: code for code, dtype in enumerate(_ELEMS)}
KERNEL_KV_DTYPES = {
    torch.float32: (torch.float32, torch.float16, *QUANTIZED_KV_DTYPES),
    torch.bfloat16: (torch.bfloat16,),
}


@dataclass(frozen=True)
class PagedAttentionKernel:
    """fp32/bf16 paged attention over K/V read in place, fp16/fp8/q8_0 K/V under fp32 (see
    paged_attention.c for the contract). `long_queries`: its flash path for prefill chunks
    (paged_prefill_attention: fp32 queries, head sizes a multiple of 16), where it is built.
    quantize_fn / dequantize_fn: kv_quant.h's row conversions alone (tests)."""

    fn: ctypes._CFuncPtr
    long_fn: ctypes._CFuncPtr
    long_supported_fn: ctypes._CFuncPtr
    quantize_fn: ctypes._CFuncPtr | None = None
    dequantize_fn: ctypes._CFuncPtr | None = None

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        reqs: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        long_queries: bool = False,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Fill out[rows of reqs] from q [T, Hq, D] (row-strided), kv_cache [2, NB, bs, Hkv, row]
        (a row: D values in the cache's type, kv_quant.py); by the flash path when
        `long_queries` (then takes_long_queries must hold). k_scale, v_scale: fp8 K/V's
        per-tensor scales. `window`: a sliding window (each query sees its last `window` keys,
        itself included); None: every earlier key. `softcap`: scores -> softcap * tanh(scores /
        softcap) before the softmax (Gemma 2's attn_logit_softcapping); None: none. `sinks`
        [Hq] fp32 (gpt-oss's attention sinks): a logit per query head that joins its softmax's
        max and sum with no value, neither scaled nor soft-capped; None: none."""
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        assert (
            q.stride(2) == 1
            and q.stride(1) == head_dim
            and out.stride(2) == 1
            and out.stride(1) == head_dim
        )
        # the index tensors are checked once per step: check_indices
        assert kv_cache.is_contiguous()
        assert q.dtype == out.dtype and kv_cache.dtype in KERNEL_KV_DTYPES.get(q.dtype, ())
        if sinks is not None:
            check_sinks(sinks, num_heads, q.device)
        fn = self.long_fn if long_queries else self.fn
        status = fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            num_heads,
            block_tables.data_ptr(),
            block_tables.stride(0),
            query_start.data_ptr(),
            seq_lens.data_ptr(),
            reqs.data_ptr(),
            reqs.numel(),
            ctypes.c_float(scale),
            ctypes.c_float(k_scale),
            ctypes.c_float(v_scale),
            out.data_ptr(),
            out.stride(0),
            KERNEL_DTYPES[q.dtype],
            KERNEL_DTYPES[kv_cache.dtype],
            torch.get_num_threads(),
            window or 0,
            ctypes.c_float(softcap or 0.0),
            None if sinks is None else sinks.data_ptr(),
        )
        if status == -2:
            raise ValueError(
                f"paged_prefill_attention does not take {q.dtype} queries over {kv_cache.dtype} "
                f"K/V at head size {head_dim} here (takes_long_queries)"
            )
        if status != 0:
            raise MemoryError("paged_attention: out of memory for its scratch buffers")

    def takes_long_queries(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the flash path runs these queries, K/V and head size (fp32 queries; fp32,
        fp16, fp8 or q8_0 K/V; head size a multiple of 16 up to 256; a build with
        AVX2+FMA+F16C or AVX-512)."""
        if dtype not in KERNEL_DTYPES or kv_dtype not in KERNEL_DTYPES:
            return False
        return bool(self.long_supported_fn(KERNEL_DTYPES[dtype], KERNEL_DTYPES[kv_dtype], head_dim))


def check_indices(*index: torch.Tensor) -> None:
    """The kernel reads block tables, query starts, sequence lengths and request ids as
    row-major int64 arrays in host memory."""
    for tensor in index:
        assert (
            tensor.dtype == torch.int64 and tensor.device.type == "cpu" and tensor.stride(-1) == 1
        )


def load_paged_attention(
    cpu: CpuFeatures | None = None, source: Path = _SOURCE
) -> PagedAttentionKernel:
    """Build (or find in the cache) and load the kernel; NativeBuildError says why not.
    `source`: another paged_attention.c (with its headers beside it), for a benchmark to time a
    kernel change against the build before it in one process (benchmarks/attention_layer.py)."""
    lib = load_library(source, cpu)
    return PagedAttentionKernel(
        *(
            bind(lib, name)
            for name in (
                "paged_attention",
                "paged_prefill_attention",
                "paged_prefill_supported",
                "kv_quantize_rows",
                "kv_dequantize_rows",
            )
        )
    )
