"""Paged attention: portable torch ops (CPU and CUDA), or the native CPU kernel (model/native).

Per layer and step: FIRST write every token's K/V through `slot_mapping`, THEN read through
block tables, so a block written this step by one request can be read by another request of
the same step (prefix caching relies on it).

K/V are stored in the pool's type (--kv-cache-dtype; model/kv_quant.py): fp8 and q8_0 rows are
quantized as they are written; the native kernel reads them in place, the torch path
dequantizes the blocks it gathers.

Reading, with requests ordered decodes first (see ForwardContext):
- with the native CPU kernel (model/native, fp32 or bf16): every request of at most
  NATIVE_MAX_QUERY_LEN queries (decodes, spec-decode verification, short chunks) in one call
  that reads its K/V in place; longer ones in a second call, by the kernel's flash path, where
  it takes them (fp32 queries, head size a multiple of 16), else by the prefill path below.
  Otherwise:
- the `num_decodes` single-query requests: batched `scaled_dot_product_attention` over their
  gathered blocks, in tiles of consecutive requests, each tile padded to its longest request
  and masked by `seq_lens`, and sized so its gathered K/V stays in cache (DECODE_TILE_BYTES; on
  a GPU, GPU_DECODE_TILE_BYTES: few large tiles);
- every other request (prefill chunk, spec-decode verification): its own SDPA over its
  gathered context, with a causal mask aligned to the END: query i of a request with q_len
  queries and seq_len keys sees keys 0 .. seq_len - q_len + i.
GQA never repeats K/V: decode folds the G query heads of one KV head into G query rows, and
prefill uses SDPA's `enable_gqa`.

A sliding window (a layer's `sliding_window`, Mistral's and Gemma's local layers): query at
position p sees keys p - window < key <= p, as HF transformers' sliding_window_overlay. Layers
of one window share one windowed plan a step (`AttentionPlan.windowed`: the same batches, masks
narrowed, the native kernel told the window); keys before the window are never read, so their
blocks may have been handed back (the null block: core/kv/hybrid.py).

`AttentionPlan` holds the index tensors and masks derived from a ForwardContext; it is built
once per step (by the worker, through model/attention_backend.py) and shared by all layers.

Attention sinks (gpt-oss: `sinks`, a logit per query head): each query's softmax takes one more
logit, its head's sink, in its denominator and no value, as HF's eager attention appends a sink
column to the scores and drops it after the softmax. The sink is neither scaled nor soft-capped.
Every plan takes them (the native kernel, its flash path, the torch tiles and spans, the static
plans); with none, every path computes what it did before.

A captured step (a CUDA graph) reads a static plan instead (`TorchDecodePlan`, or the Triton
backend's): a uniform batch (every request the same q_len: decodes, or spec-decode
verifications of k drafts) whose tensor shapes depend only on the padded token count, with
padding requests that read and write only the null block (block 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tokenbus.model import kv_quant
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.native import (
    KERNEL_KV_DTYPES,
    PagedAttentionKernel,
    check_indices,
)
from tokenbus.model.sdpa import check_sinks, folded_sinks, sdpa
from tokenbus.utils import cdiv

# Gathered K+V bytes per decode tile: big enough to amortise per-op overhead, small enough to
# stay in cache between the gather and the SDPA that reads it. benchmarks/decode_step.py
# --tile-mib decides the size.
DECODE_TILE_BYTES = 2 << 20
# On a GPU (the fallback when Triton cannot run there) no cache holds a tile between its gather
# and its SDPA, and each tile costs launches: few large tiles, bounded so the gathered copy
# stays a small share of device memory (32 layers of an 8B at batch 64 and 2K context would
# otherwise be ~2,000 tiles a step).
GPU_DECODE_TILE_BYTES = 256 << 20
# Requests with at most this many queries go to the native kernel's decode path, which reads K/V
# once per (request, KV head) but computes scores row by row (on AVX-512 at head size 64, once per
# query token, so a row's bits do not depend on its request's query count); longer chunks go to
# its flash path (paged_prefill_attention), or to SDPA's GEMMs where that does not run.
NATIVE_MAX_QUERY_LEN = 16


@dataclass(frozen=True)
class DecodeTile:
    """Decode requests [start, end) of the batch (== their token rows: one token each)."""

    start: int
    end: int
    # [n, num_blocks] int64: first blocks of each table (enough for the longest)
    block_ids: torch.Tensor
    bias: torch.Tensor  # [n, 1, 1, num_blocks * block_size]: 0 for keys < seq_len, -inf after
    seq_lens: torch.Tensor  # [n] int64, at least 1 (a padding request sees key 0)
    min_seq_len: int = 1  # the shortest of seq_lens, on the host

    def windowed(self, window: int) -> DecodeTile:
        """Keys before seq_len - window masked too; the blocks before every row's window are
        not gathered (they may have been handed back: core/kv/hybrid.py)."""
        block_size = self.bias.shape[-1] // self.block_ids.shape[1]
        first = max(self.min_seq_len - window, 0) // block_size  # the first block any row reads
        bias = self.bias[..., first * block_size :]
        key_ids = torch.arange(bias.shape[-1], device=bias.device) + first * block_size
        early = key_ids[None, :] < (self.seq_lens - window)[:, None]  # [n, L]
        bias = bias.masked_fill(early[:, None, None, :], float("-inf"))
        return dataclasses.replace(self, block_ids=self.block_ids[:, first:], bias=bias)


@dataclass(frozen=True)
class PrefillSpan:
    """One multi-token request: token rows [start, end) of the batch, seq_len keys in the cache."""

    start: int
    end: int
    seq_len: int
    # [num_blocks] int64; None: no earlier context (keys = this step's)
    block_ids: torch.Tensor | None
    # [q_len, seq_len - key_offset]: 0 where visible, -inf where not; None: plain causal
    bias: torch.Tensor | None
    # keys before it are not gathered (a sliding window's, rounded down to a block); block_ids
    # start at its block
    key_offset: int = 0
    block_size: int = 1  # of the tables block_ids come from
    dtype: torch.dtype = torch.float32  # of the masks (the activations')

    def windowed(self, window: int) -> PrefillSpan:
        """Causal and within the window (a float mask: an additive one for any attention); with
        earlier context, the blocks before the first query's window are not gathered."""
        q_len = self.end - self.start
        device = self.bias.device if self.bias is not None else None
        block_ids, offset = self.block_ids, 0
        if block_ids is not None:
            first = max(self.seq_len - q_len + 1 - window, 0) // self.block_size
            block_ids, offset = block_ids[first:], first * self.block_size
        query_pos = torch.arange(self.seq_len - q_len, self.seq_len, device=device)[:, None]
        key_ids = torch.arange(offset, self.seq_len, device=device)[None, :]
        visible = (key_ids <= query_pos) & (key_ids > query_pos - window)
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=device)
        bias.masked_fill_(~visible, float("-inf"))
        return dataclasses.replace(self, block_ids=block_ids, bias=bias, key_offset=offset)


@dataclass(frozen=True)
class NativeBatch:
    """Requests `reqs` (indices into the step's requests) for the native kernel; `long_queries`:
    by its flash path (prefill chunks)."""

    kernel: PagedAttentionKernel
    reqs: torch.Tensor  # [n] int64
    query_start: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64
    long_queries: bool = False
    window: int | None = None  # a sliding window, told to the kernel

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        k_scale, v_scale = kv_quant.tensor_scales(kv_cache.dtype)
        self.kernel(
            q,
            kv_cache,
            self.block_tables,
            self.query_start,
            self.seq_lens,
            self.reqs,
            scale,
            out,
            self.long_queries,
            k_scale,
            v_scale,
            self.window,
            softcap,
            sinks,
        )


@dataclass(frozen=True)
class AttentionPlan:
    decode_tiles: list[DecodeTile]
    prefills: list[PrefillSpan]
    num_tokens: int
    native: NativeBatch | None = None  # decode-sized requests
    native_long: NativeBatch | None = None  # prefill chunks, by the flash path
    # window -> this plan narrowed to it, made by the first layer of that window a step
    _windowed: dict[int, AttentionPlan] = field(default_factory=dict, compare=False, repr=False)

    def windowed(self, window: int) -> AttentionPlan:
        """This step's plan for layers with a sliding `window` (made once, shared by them)."""
        plan = self._windowed.get(window)
        if plan is None:
            batches = (
                None if batch is None else dataclasses.replace(batch, window=window)
                for batch in (self.native, self.native_long)
            )
            plan = AttentionPlan(
                [tile.windowed(window) for tile in self.decode_tiles],
                [span.windowed(window) for span in self.prefills],
                self.num_tokens,
                *batches,
            )
            self._windowed[window] = plan
        return plan

    def native_decode_only(self, num_rows: int) -> bool:
        """Whether every query of a step of `num_rows` rows goes to the native kernel's decode
        path: no flash-path chunk, no torch tile or span, no padding rows past num_tokens."""
        return (
            self.native is not None
            and self.native_long is None
            and not self.decode_tiles
            and not self.prefills
            and self.num_tokens == num_rows
        )

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
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # padding rows stay 0
        for batch in (self.native, self.native_long):
            if batch is not None:
                batch.run(q, kv_cache, scale, out, softcap, sinks)
        for tile in self.decode_tiles:
            out[tile.start : tile.end] = _decode_attention(
                q[tile.start : tile.end], kv_cache, tile, scale, softcap, sinks
            )
        for span in self.prefills:
            rows = slice(span.start, span.end)
            out[rows] = _prefill_attention(
                q[rows], k[rows], v[rows], kv_cache, span, scale, softcap, sinks
            )
        return out


@dataclass(frozen=True)
class TorchDecodePlan:
    """A uniform batch for the portable path with static shapes: each query token attends the
    first positions[t] + 1 keys of its request's blocks, gathered at the tables' full width W
    (one tile of W * block_size keys per token: the price of a shape fixed at capture)."""

    num_tokens: int
    block_tables: torch.Tensor  # [R, W] int64
    token_requests: torch.Tensor  # [T] int64: the request (row of block_tables) of each token
    positions: torch.Tensor  # [T] int64
    window: int | None = None  # a sliding window: keys at positions[t] - window or before masked

    def windowed(self, window: int) -> TorchDecodePlan:
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
        write_kv(kv_cache, k, v, slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        tables = self.block_tables.index_select(0, self.token_requests)  # [T, W]
        kv = gather_blocks(kv_cache, tables, q.dtype)
        kv = kv.view(2, num_tokens, -1, num_kv_heads, head_dim)  # [2, T, L, Hkv, D]
        kv = kv.transpose(2, 3)  # [2, T, Hkv, L, D]
        key_ids = torch.arange(tables.shape[1] * block_size, device=q.device)
        masked = key_ids[None, :] > self.positions[:, None]  # [T, L]: after the token itself
        if self.window is not None:
            masked |= key_ids[None, :] <= (self.positions - self.window)[:, None]
        bias = torch.zeros(masked.shape, dtype=q.dtype, device=q.device).masked_fill_(
            masked, float("-inf")
        )
        q = q.view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [T, Hkv, G, D]
        out = sdpa(
            q,
            kv[0],
            kv[1],
            attn_mask=bias[:, None, None, :],
            scale=scale,
            softcap=softcap,
            sinks=folded_sinks(sinks, num_kv_heads),
        )
        return out.reshape(num_tokens, num_heads, head_dim)


Plan = AttentionPlan | TorchDecodePlan  # or a backend's own (triton_attention.TritonPlan)


def build_attention_plan(
    ctx: ForwardContext, dtype: torch.dtype, native_kernel: PagedAttentionKernel | None = None
) -> AttentionPlan:
    """Derive per-step index tensors and masks (in the activation `dtype`) from `ctx`."""
    kv = ctx.first_kv_cache
    block_size = kv.shape[2]
    # One plan serves every layer: where their K/V differ in shape (Gemma 4's), the flash
    # path must take the widest head, and a decode tile holds the largest layer's keys.
    shapes = {(cache.shape[3], kv_quant.head_dim_of(cache)) for cache in ctx.attention_kv_caches}
    head_dim = max(dim for _, dim in shapes)
    if (
        native_kernel is not None
        and kv.dtype in KERNEL_KV_DTYPES.get(dtype, ())
        and kv.device.type == "cpu"
    ):
        return _plan_native(ctx, native_kernel, block_size, dtype, kv.dtype, head_dim)
    # K and V, as gathered, of the layer whose keys are largest
    key_values = max(heads * dim for heads, dim in shapes)
    bytes_per_key = 2 * key_values * torch.finfo(dtype).bits // 8
    decode_tiles = _plan_decode_tiles(ctx, block_size, bytes_per_key, dtype)
    prefills = [
        _plan_prefill(ctx, r, block_size, dtype) for r in range(ctx.num_decodes, ctx.num_reqs)
    ]
    return AttentionPlan(decode_tiles, prefills, ctx.num_tokens)


def _plan_native(
    ctx: ForwardContext,
    kernel: PagedAttentionKernel,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
) -> AttentionPlan:
    """Requests of up to NATIVE_MAX_QUERY_LEN queries to the kernel; longer ones to its flash
    path where it takes them (takes_long_queries), else to SDPA."""
    starts = ctx.query_start_loc
    native, long, prefills = [], [], []
    long_queries = None  # asked of the kernel at the first long request (a decode step has none)
    for r in range(ctx.num_reqs):
        q_len = starts[r + 1] - starts[r]
        if q_len > NATIVE_MAX_QUERY_LEN:
            if long_queries is None:
                long_queries = kernel.takes_long_queries(dtype, kv_dtype, head_dim)
            if long_queries:
                long.append(r)
            else:
                prefills.append(_plan_prefill(ctx, r, block_size, dtype))
        elif q_len > 0 and ctx.seq_lens[r] > 0:  # padding requests keep their zero rows
            native.append(r)
    query_start = torch.tensor(starts, dtype=torch.int64)
    batches = [
        NativeBatch(
            kernel,
            torch.tensor(reqs, dtype=torch.int64),
            query_start,
            ctx.seq_lens_t,
            ctx.block_tables,
            long_queries=is_long,
        )
        if reqs
        else None
        for reqs, is_long in ((native, False), (long, True))
    ]
    made = [batch for batch in batches if batch is not None]
    if made:  # once per step: the batches share everything but their request ids
        check_indices(
            query_start, ctx.seq_lens_t, ctx.block_tables, *(batch.reqs for batch in made)
        )
    return AttentionPlan([], prefills, ctx.num_tokens, *batches)


def _plan_decode_tiles(
    ctx: ForwardContext, block_size: int, bytes_per_key: int, dtype: torch.dtype
) -> list[DecodeTile]:
    if ctx.num_decodes == 0:
        return []
    # A padded request (seq_len 0) may attend key 0 (the null block): its row stays finite.
    seq_lens = ctx.seq_lens_t[: ctx.num_decodes].clamp(min=1)
    budget = DECODE_TILE_BYTES if seq_lens.device.type == "cpu" else GPU_DECODE_TILE_BYTES
    tiles = []
    for start, end, num_blocks in _tile_rows(
        ctx.seq_lens[: ctx.num_decodes], block_size, bytes_per_key, budget
    ):
        key_ids = torch.arange(num_blocks * block_size, device=seq_lens.device)
        # [n, num_keys]: past the request's end
        masked = key_ids[None, :] >= seq_lens[start:end, None]
        bias = torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(
            masked, float("-inf")
        )
        tiles.append(
            DecodeTile(
                start,
                end,
                ctx.block_tables[start:end, :num_blocks],
                bias[:, None, None, :],
                seq_lens[start:end],
                max(min(ctx.seq_lens[start:end]), 1),
            )
        )
    return tiles


def _tile_rows(
    seq_lens: list[int], block_size: int, bytes_per_key: int, budget: int
) -> list[tuple[int, int, int]]:
    """Split decode rows into runs (start, end, num_blocks) whose K/V, padded to the run's longest
    request (num_blocks), fits `budget` bytes; a run has at least one row."""
    tiles, start, num_blocks = [], 0, 0
    for row, seq_len in enumerate(seq_lens):
        widest = max(num_blocks, cdiv(max(seq_len, 1), block_size))
        if row > start and (row + 1 - start) * widest * block_size * bytes_per_key > budget:
            tiles.append((start, row, num_blocks))
            start, widest = row, cdiv(max(seq_len, 1), block_size)
        num_blocks = widest
    tiles.append((start, len(seq_lens), num_blocks))
    return tiles


def _plan_prefill(
    ctx: ForwardContext, req: int, block_size: int, dtype: torch.dtype
) -> PrefillSpan:
    start, end = ctx.query_start_loc[req], ctx.query_start_loc[req + 1]
    q_len, seq_len = end - start, ctx.seq_lens[req]
    if q_len == seq_len:  # the whole context is this step's tokens: plain causal attention
        return PrefillSpan(start, end, seq_len, None, None, block_size=block_size, dtype=dtype)
    block_ids = ctx.block_tables[req, : cdiv(seq_len, block_size)]
    device = block_ids.device
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # position of query i
    # [q_len, seq_len]: future keys
    masked = torch.arange(seq_len, device=device)[None, :] > query_pos[:, None]
    bias = torch.zeros(masked.shape, dtype=dtype, device=device).masked_fill_(masked, float("-inf"))
    return PrefillSpan(start, end, seq_len, block_ids, bias, block_size=block_size, dtype=dtype)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at slots (block_id * block_size + offset) of kv_cache
    [2, NB, bs, Hkv, row] (rounded or quantized to the cache's type: --kv-cache-dtype)."""
    _, _, _, num_kv_heads, width = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, width)  # [2, NB * bs, Hkv, row]
    kv_quant.write_rows(flat[0], slot_mapping, k)
    kv_quant.write_rows(flat[1], slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: Plan,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this step -> attention output [T, Hq, D]. `window`: a
    sliding window (each query sees its last `window` keys, itself included); `softcap` (Gemma
    2's attn_logit_softcapping): scores -> softcap * tanh(scores / softcap) before the softmax;
    `sinks` (gpt-oss's) [Hq] fp32 on q's device: a logit per query head in its softmax's
    denominator, with no value. Every plan takes both; each is passed on only when set."""
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
    if window is not None:
        narrow = getattr(plan, "windowed", None)
        if narrow is None:  # the kernel plan keeps windowed models off such backends
            raise ValueError(f"{type(plan).__name__} does not take a sliding window")
        plan = narrow(window)
    options = {}
    if softcap is not None:
        options["softcap"] = softcap
    if sinks is not None:
        options["sinks"] = sinks
    return plan.forward(q, k, v, kv_cache, slot_mapping, scale, **options)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Copy out blocks: kv_cache [2, NB, bs, Hkv, row], block_ids [*] ->
    [2, len(block_ids) * bs, Hkv, D] in `dtype` (the queries', where the cache holds another:
    --kv-cache-dtype; quantized rows are dequantized here, in the copy).

    index_select over whole blocks (contiguous rows) is faster than kv_cache[:, ids]
    (benchmarks/attention_layer.py times the torch path).
    """
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    rows = kv_cache.view(2, num_blocks, -1).index_select(
        1, block_ids.reshape(-1)
    )  # [2, n_ids, bs*Hkv*row]
    return kv_quant.dequantize(rows.view(2, -1, num_kv_heads, width), dtype)


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tile: DecodeTile,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] (one query per request) -> [n, Hq, D]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    kv = gather_blocks(kv_cache, tile.block_ids, q.dtype).view(
        2, n, -1, num_kv_heads, head_dim
    )  # [2, n, L, Hkv, D]
    kv = kv.transpose(2, 3)  # [2, n, Hkv, L, D]
    # GQA: query head h uses KV head h // G, so view the G heads of a KV head as G query rows.
    q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [n, Hkv, G, D]
    out = sdpa(
        q,
        kv[0],
        kv[1],
        attn_mask=tile.bias,
        scale=scale,
        softcap=softcap,
        sinks=folded_sinks(sinks, num_kv_heads),
    )
    return out.reshape(n, num_heads, head_dim)  # [n, Hkv, G, D] -> [n, Hq, D]


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [q_len, Hq, D], k/v [q_len, Hkv, D] of this step -> [q_len, Hq, D]."""
    q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    if sinks is not None:
        sinks = sinks.view(-1, 1, 1)  # [Hq, 1, 1]: one per head, for each of its queries
    if span.block_ids is None:
        # attend over K/V as the cache holds them, as later steps will
        k, v = kv_quant.as_stored(k, kv_cache.dtype), kv_quant.as_stored(v, kv_cache.dtype)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, q_len, D]
        out = sdpa(
            q,
            k,
            v,
            attn_mask=None if span.bias is None else span.bias.to(q.device),  # a window's
            is_causal=span.bias is None,
            scale=scale,
            enable_gqa=True,
            softcap=softcap,
            sinks=sinks,
        )
    else:
        kv = gather_blocks(kv_cache, span.block_ids, q.dtype)[
            :, : span.seq_len - span.key_offset
        ]  # [2, seq_len - key_offset, Hkv, D]
        kv = kv.transpose(1, 2).unsqueeze(1)  # [2, 1, Hkv, seq_len, D]
        out = sdpa(
            q,
            kv[0],
            kv[1],
            attn_mask=span.bias,
            scale=scale,
            enable_gqa=True,
            softcap=softcap,
            sinks=sinks,
        )
    return out[0].transpose(0, 1)  # [1, Hq, q_len, D] -> [q_len, Hq, D]
