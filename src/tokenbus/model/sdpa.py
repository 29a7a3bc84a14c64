"""Scaled dot-product attention with the score changes some families make (L2): Gemma 2's
soft-cap and gpt-oss's attention sinks, in the order of HF's eager attention, for the torch
path's plans (model/attention.py); and the one check every kernel makes of the sinks.

SDPA has neither change, so that path spells attention out in explicit ops, which hold whole
score rows ([..., H, Lq, Lk], an fp32 copy with the sink column, the probs): for a long prefill
chunk with many heads, gigabytes. It therefore takes the queries a chunk of rows at a time, each
chunk's scores within SCORES_BUDGET_BYTES; a row's softmax needs only that row, so the rows
come out as in one piece.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# fp32 scores one query chunk of the explicit path may hold (its softmax input and probs are
# the same size again): bounds that path's memory whatever Lq, heads and Lk.
SCORES_BUDGET_BYTES = 64 << 20


def check_sinks(sinks: torch.Tensor, num_heads: int, device: torch.device) -> None:
    """Every kernel reads sinks as one contiguous fp32 value per query head, on the queries'
    device: a ValueError saying what they are otherwise."""
    if (
        sinks.dtype != torch.float32
        or sinks.shape != (num_heads,)
        or sinks.device != device
        or not sinks.is_contiguous()
    ):
        raise ValueError(
            f"sinks must be contiguous float32 [{num_heads}] on {device}, got {sinks.dtype} "
            f"{list(sinks.shape)} on {sinks.device}"
        )


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.scaled_dot_product_attention; with `softcap` or `sinks`, the same in explicit ops in
    the order of HF's eager attention (SDPA has neither): the scores soft-capped before the mask,
    and a sink logit per query row joining the softmax (a column appended, then dropped), the
    queries taken in chunks of rows within SCORES_BUDGET_BYTES of scores.
    q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D] (Hq a multiple of Hkv only with enable_gqa);
    attn_mask broadcastable to [..., Hq, Lq, Lk]; sinks broadcastable to [..., Hq, Lq, 1]."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:  # query head h reads KV head h // groups (HF's repeat_kv)
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    # query i sees keys 0 .. Lk - Lq + i: a chunk from row `start` keeps the tril diagonal
    # Lk - Lq + start, so every row keeps its own keys
    diagonal = num_keys - num_queries if is_causal else None
    rows = _rows_per_chunk(q, k)
    if rows >= num_queries:
        return _explicit_attention(q, k, v, attn_mask, diagonal, scale, softcap, sinks)
    chunks = []
    for start in range(0, num_queries, rows):
        end = min(start + rows, num_queries)
        chunks.append(
            _explicit_attention(
                q[..., start:end, :],
                k,
                v,
                _query_rows(attn_mask, start, end, num_queries),
                None if diagonal is None else diagonal + start,
                scale,
                softcap,
                _query_rows(sinks, start, end, num_queries),
            )
        )
    return torch.cat(chunks, dim=-2)


def _rows_per_chunk(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query rows whose fp32 scores, over every leading dim and head, fit SCORES_BUDGET_BYTES
    (at least one, so a row too wide for it still runs)."""
    score_rows = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    row_bytes = score_rows * k.shape[-2] * 4  # fp32
    return max(1, SCORES_BUDGET_BYTES // max(1, row_bytes))


def _query_rows(
    t: torch.Tensor | None, start: int, end: int, num_queries: int
) -> torch.Tensor | None:
    """Rows start:end of a mask or sinks that has one row per query (dim -2 of size Lq); one
    broadcast over the queries (size 1 there, or no such dim) serves every chunk as it is."""
    if t is None or t.dim() < 2 or t.shape[-2] != num_queries or num_queries == 1:
        return t
    return t[..., start:end, :]


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    diagonal: int | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk of sdpa's explicit path, k/v already one per query head; `diagonal` (causal
    only) the last key the chunk's first query sees."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, rows, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if diagonal is not None:
        num_queries, num_keys = scores.shape[-2:]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(~visible.tril(diagonal), float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # the sink column is neither scaled nor soft-capped, and has no value
        column = sinks.to(torch.float32).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores.to(torch.float32), column], dim=-1)  # [..., rows, Lk + 1]
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def folded_sinks(sinks: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor | None:
    """Sinks [Hq] as sdpa reads them for queries folded [.., Hkv, G, D] (GQA decode: the G
    heads of a KV head as G query rows): [Hkv, G, 1]."""
    return None if sinks is None else sinks.view(num_kv_heads, -1, 1)
