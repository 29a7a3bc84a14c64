"""Paged attention in Triton: one kernel family for a mixed batch, K/V read in place (L2).

Two kernels, called once per layer and step, in this order (the KV-write-before-read rule of
model/attention.py):

- `write_kv`: each token's K and V into its slot of the paged cache
  (slot = block_id * block_size + offset; a negative slot is skipped).
- `paged_attention`: for every request of the step, decodes, prefill chunks and spec-decode
  verifications alike, its queries against the keys in its blocks, causal with the mask
  aligned to the END of the request's context: query i of a request with q_len queries and
  seq_len keys sees keys 0 .. seq_len - q_len + i.

Work split: one program per (request, block of BLOCK_M query tokens, KV head). GQA never
repeats K/V: the G query heads of one KV head are folded into the program's rows (row
r = token r // BLOCK_G, head r % BLOCK_G), so each K/V block is loaded once for all of them.
Softmax is online (FlashAttention's running max and sum), in fp32 whatever the K/V dtype
(fp32, fp16, bf16, or fp8 e4m3 / e5m2: --kv-cache-dtype fp8).

With `split_kv` > 1, requests of one query token (decodes) split their keys into that many
segments, each program writes a partial (max, sum, output) and `_merge_splits` combines them:
FlashAttention's split-K decode, which keeps the GPU busy when a batch has few long requests.

Three per-layer options, as model/attention.py's torch path has them: a sliding `window` (a
query sees its last `window` keys, itself included; blocks wholly before the earliest query's
window are never read, so a hybrid KV cache may have freed them), `softcap` (Gemma 2's
attn_logit_softcapping: scores -> softcap * tanh(scores / softcap), before the mask), and
`sinks` (gpt-oss's: a logit per query head in the softmax's denominator, with no value). A sink
starts a row's online softmax as a key of no value would: running max m = sink, sum l =
e^(sink - m) = 1, so each rescale by e^(m_old - m_new) keeps its term exact. Under split_kv only
split 0 starts from it (the merge then counts it once).

The kernels run on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (how the test suite
checks them against the torch path).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenbus.model import kv_quant
from tokenbus.model.sdpa import check_sinks

# Rows of a program: BLOCK_M query tokens × BLOCK_G heads, at least 16 (tl.dot's minimum).
MIN_ROWS = 16
MAX_SPLITS = 16  # key segments of one decode at most (decode_splits)
MIN_BLOCK_SIZE = 16  # KV block tokens are a tl.dot dimension: 16 at least
# K/V element types the kernels read in place: the float types, and fp8 stored as x / KV_SCALE
# with KV_SCALE 1.0 (kv_quant.py), so a loaded value is x itself. q8_0 rows are not read here.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *kv_quant.FP8_MAX)
assert kv_quant.KV_SCALE == 1.0, "fp8 caches are read without a scale"


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    cache_half,  # elements from the K half of the cache to its V half: NB * bs * Hkv * D
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,  # an fp8 cache: values saturate at its largest finite one (else 0)
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    k = tl.load(k_ptr + token * stride_k_token + head * stride_k_head + d, mask=d_mask)
    v = tl.load(v_ptr + token * stride_v_token + head * stride_v_head + d, mask=d_mask)
    if FP8_MAX > 0:  # as kv_quant.write_rows: x / KV_SCALE (1.0), saturated, then rounded
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
    dst = cache_ptr + (slot * NUM_KV_HEADS + head) * HEAD_DIM + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(dst + cache_half, v.to(cache_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["split_kv", "window"])
def _attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_ptr,  # split_kv > 1: [num_tokens, Hq, split_kv, HEAD_DIM + 2] fp32 partials
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_table,
    cache_half,
    split_kv,  # key segments per decode (1: none); a runtime value, so no recompile per batch
    window,  # a sliding window in keys (0: none)
    softcap,  # the soft-cap of the scores (read under SOFTCAP only)
    sinks_ptr,  # [Hq] fp32: each query head's attention sink (read under SINKS only)
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    axis2 = tl.program_id(2)
    kv_head = axis2 % NUM_KV_HEADS
    split = axis2 // NUM_KV_HEADS

    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    if q_block * BLOCK_M >= q_len:
        return
    if (split > 0) & (q_len != 1):  # only decodes are split; split 0 does a longer one whole
        return
    is_split = (split_kv > 1) & (q_len == 1)

    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    token = q_block * BLOCK_M + rows // BLOCK_G  # index among the request's queries
    group = rows % BLOCK_G
    row_mask = (token < q_len) & (group < GROUP)
    head = kv_head * GROUP + group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_token + head[:, None] * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    query_pos = seq_len - q_len + token  # the query's own position: it sees keys <= it
    # Under a window, keys at query_pos - window or before are out of sight too.
    window_edge = tl.where(window > 0, query_pos - window, -1)

    # Keys this program needs: from its first query's window (block 0 without one) up to its
    # last query's position; a split takes its share of those blocks.
    first_query = seq_len - q_len + q_block * BLOCK_M
    skipped = tl.where(window > 0, tl.maximum(first_query - window + 1, 0) // BLOCK_SIZE, 0)
    num_keys = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_M)
    num_blocks = (num_keys + BLOCK_SIZE - 1) // BLOCK_SIZE
    # One segment of the blocks per split; the whole range otherwise (tl.where keeps every
    # bound one type, int64, whichever way the request goes).
    num_segments = tl.where(is_split, split_kv, 1)
    per_split = (num_blocks - skipped + num_segments - 1) // num_segments
    first_block = skipped + tl.where(is_split, split * per_split, 0)
    last_block = tl.minimum(num_blocks, first_block + per_split)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    if SINKS:
        if split == 0:  # the sink as a first key of no value, counted once (split 0's partial)
            m_i = tl.load(sinks_ptr + head, mask=row_mask, other=float("-inf"))
            l_i = tl.where(row_mask, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for j in range(first_block, last_block):
        block_id = tl.load(block_tables_ptr + req * stride_table + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + offsets
        kv_off = (
            (block_id * BLOCK_SIZE + offsets[:, None]) * NUM_KV_HEADS + kv_head
        ) * HEAD_DIM + d[None, :]
        k = tl.load(cache_ptr + kv_off, mask=d_mask[None, :], other=0.0).to(q.dtype)
        v = tl.load(cache_ptr + cache_half + kv_off, mask=d_mask[None, :], other=0.0).to(q.dtype)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh from one exp of a non-positive power
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            s = tl.where(s < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < seq_len)
        visible = visible & (key_pos[None, :] > window_edge[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_mask[:, None] & d_mask[None, :]
    if is_split:
        # Partials [token, head, split, D + 2]: the unnormalised output, then max and sum.
        base = ((q_rows * (NUM_KV_HEADS * GROUP) + head) * split_kv + split) * (HEAD_DIM + 2)
        tl.store(part_ptr + base[:, None] + d[None, :], acc, mask=out_mask)
        tl.store(part_ptr + base + HEAD_DIM, m_i, mask=row_mask)
        tl.store(part_ptr + base + HEAD_DIM + 1, l_i, mask=row_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_o_token + head[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit(do_not_specialize=["split_kv"])
def _merge_splits_kernel(
    part_ptr,
    out_ptr,
    query_start_ptr,
    stride_o_token,
    stride_o_head,
    split_kv,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """Combine a decode's split partials: out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + req)
    if tl.load(query_start_ptr + req + 1) - q_start != 1:
        return
    token = q_start.to(tl.int64)
    splits = tl.arange(0, MAX_SPLITS)
    s_mask = splits < split_kv
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = ((token * NUM_HEADS + head) * split_kv + splits) * (HEAD_DIM + 2)
    m_s = tl.load(part_ptr + base + HEAD_DIM, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ptr + base + HEAD_DIM + 1, mask=s_mask, other=0.0)
    m = tl.max(m_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m))  # an empty split weighs nothing
    acc = tl.load(
        part_ptr + base[:, None] + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at their slots of kv_cache [2, NB, bs, Hkv, D] (in its dtype)."""
    _check_cache(kv_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache[0].numel(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=kv_quant.FP8_MAX.get(kv_cache.dtype, 0.0),
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    split_kv: int = 1,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] against the cached keys of each request -> out [T, Hq, D].

    block_tables [R, W], query_start [R + 1] (token offsets of each request in q), seq_lens
    [R] (keys in the cache after this step's write, the request's own queries included).
    `max_query_len` (a host int) sizes the grid; `split_kv` > 1 splits each decode's keys.
    `window`: a sliding window (the last `window` keys of each query); `softcap`: scores ->
    softcap * tanh(scores / softcap); `sinks` [Hq] fp32 on q's device: each query head's
    attention sink. Rows of tokens that belong to no request are left as `out` had them."""
    _check_cache(kv_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if sinks is not None:
        check_sinks(sinks, num_heads, q.device)
    if out is None:
        out = torch.zeros_like(q)
    if num_reqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_m = query_tile(block_g, max_query_len)
    split_kv = min(triton.next_power_of_2(max(split_kv, 1)), MAX_SPLITS)
    partials = (
        torch.empty(
            (num_tokens, num_heads, split_kv, head_dim + 2), dtype=torch.float32, device=q.device
        )
        if split_kv > 1
        else out  # unused
    )
    grid = (num_reqs, triton.cdiv(max(max_query_len, 1), block_m), num_kv_heads * split_kv)
    _attention_kernel[grid](
        q,
        kv_cache,
        out,
        partials,
        block_tables,
        query_start,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache[0].numel(),
        split_kv,
        window or 0,
        softcap or 0.0,
        q if sinks is None else sinks,  # unused without sinks
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        FP32_DOT=q.dtype == torch.float32,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
    )
    if split_kv > 1:
        _merge_splits_kernel[(num_reqs, num_heads)](
            partials,
            out,
            query_start,
            out.stride(0),
            out.stride(1),
            split_kv,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            MAX_SPLITS=MAX_SPLITS,
        )
    return out


def query_tile(block_g: int, max_query_len: int) -> int:
    """BLOCK_M: query tokens per program. Two per head layout, so that no query length
    compiles a kernel of its own mid-serving: decode-only steps get just enough rows for
    tl.dot, every step with a longer query up to 16 tokens (64 rows)."""
    block_m = max(MIN_ROWS // block_g, 1)
    if max_query_len > 1:
        block_m = max(block_m, min(16, 64 // block_g))
    return block_m


@dataclass(frozen=True)
class TritonPlan:
    """A step's attention for the Triton kernels: the same plan serves eager steps and
    captured CUDA graphs (its tensors then sit at the addresses the graph recorded)."""

    num_tokens: int  # real tokens: rows past them are padding
    query_start: torch.Tensor  # [R + 1] int64, on the device
    seq_lens: torch.Tensor  # [R] int64, on the device
    block_tables: torch.Tensor  # [R, W] int64
    max_query_len: int
    split_kv: int = 1
    window: int | None = None  # a sliding window, for the layers that have one

    def windowed(self, window: int) -> TritonPlan:
        return dataclasses.replace(self, window=window)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n = self.num_tokens
        write_kv(kv_cache, k[:n], v[:n], slot_mapping[:n])
        out = torch.zeros_like(q)  # rows of no request (padding) stay 0
        return paged_attention(
            q,
            kv_cache,
            self.block_tables,
            self.query_start,
            self.seq_lens,
            scale,
            self.max_query_len,
            out=out,
            split_kv=self.split_kv,
            window=self.window,
            softcap=softcap,
            sinks=sinks,
        )


def decode_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key segments per decode: enough programs to fill the GPU's multiprocessors twice over
    when a batch has few (request, KV head) pairs, at most 16; 1 off the GPU."""
    if device.type != "cuda":
        return 1
    programs = 2 * _multiprocessors(device.index)
    wanted = programs // max(num_reqs * num_kv_heads, 1)
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, wanted)))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"tensor, got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[2] < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size must be >= {MIN_BLOCK_SIZE} for Triton attention")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"a {kv_cache.dtype} KV cache is not one the Triton kernels read")
