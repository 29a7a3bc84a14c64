"""Scaled dot-product attention with the score changes some families make (L2): Gemma 2's
soft-cap and gpt-oss's attention sinks, in the order of HF's eager attention, for the torch
path's plans (model/attention.py); and the one check every kernel makes of the sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    and a sink logit per query row joining the softmax (a column appended, then dropped).
    q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D] (Hq a multiple of Hkv only with enable_gqa);
    sinks broadcastable to [..., Hq, Lq, 1]."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:  # query head h reads KV head h // groups (HF's repeat_kv)
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # query i sees keys 0 .. Lk - Lq + i
        num_queries, num_keys = scores.shape[-2:]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(~visible.tril(num_keys - num_queries), float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # the sink column is neither scaled nor soft-capped, and has no value
        column = sinks.to(torch.float32).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores.to(torch.float32), column], dim=-1)  # [..., Lq, Lk + 1]
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def folded_sinks(sinks: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor | None:
    """Sinks [Hq] as sdpa reads them for queries folded [.., Hkv, G, D] (GQA decode: the G
    heads of a KV head as G query rows): [Hkv, G, 1]."""
    return None if sinks is None else sinks.view(num_kv_heads, -1, 1)
