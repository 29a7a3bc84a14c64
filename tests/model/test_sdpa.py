"""sdpa's explicit path (soft-cap, sinks) in query chunks: each chunk within the scores budget,
and the rows the same as in one piece and as the formula."""

from __future__ import annotations

import pytest
import torch

from tokenbus.model import sdpa as sdpa_module
from tokenbus.model.sdpa import sdpa

B, HQ, LQ, LK, D = 2, 4, 11, 17, 8
# 3 query rows of fp32 scores over every batch row and head: chunks of 3, 3, 3 and 2 rows
SMALL_BUDGET = 3 * B * HQ * LK * 4


def inputs(dtype, hkv=HQ, lq=LQ, lk=LK, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(B, HQ, lq, D, generator=g)  # scores past the cap
    k = 3 * torch.randn(B, hkv, lk, D, generator=g)
    v = torch.randn(B, hkv, lk, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def head_sinks(rows=1):
    """[Hq, rows, 1]: one per head, or one per head and query row."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(HQ, rows, 1, generator=g)


def chunked_and_whole(monkeypatch, *args, **kwargs):
    monkeypatch.setattr(sdpa_module, "SCORES_BUDGET_BYTES", SMALL_BUDGET)
    chunked = sdpa(*args, **kwargs)
    monkeypatch.setattr(sdpa_module, "SCORES_BUDGET_BYTES", 1 << 40)
    return chunked, sdpa(*args, **kwargs)


def test_small_budget_takes_chunks_with_a_partial_last(monkeypatch):
    calls = []
    explicit = sdpa_module._explicit_attention

    def counting(q, *args):
        calls.append(q.shape[-2])
        return explicit(q, *args)

    monkeypatch.setattr(sdpa_module, "_explicit_attention", counting)
    chunked_and_whole(monkeypatch, *inputs(torch.float32), softcap=2.0)
    assert calls == [3, 3, 3, 2, LQ]


CASES = {
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=head_sinks()),
    "sinks per query row": dict(sinks=head_sinks(LQ)),
    "softcap and sinks": dict(softcap=2.0, sinks=head_sinks()),
    "causal after a cached prefix": dict(softcap=2.0, sinks=head_sinks(), is_causal=True),
    "causal over its own keys": dict(softcap=2.0, sinks=head_sinks(), is_causal=True, lk=LQ),
    "mask per query row": dict(softcap=2.0, mask_rows=LQ),
    "mask for every query": dict(sinks=head_sinks(), mask_rows=1),
    "gqa": dict(softcap=2.0, sinks=head_sinks(), is_causal=True, hkv=2),
}


# fp32: the matmuls of a few rows may round unlike those of all of them, by a few ulps of
# outputs up to about 2 (an AVX-512 EPYC's oneDNN kernels: 1.07e-6 apart, 9 ulps at 1.45)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", CASES)
def test_chunked_is_whole(monkeypatch, case, dtype, atol):
    options = dict(CASES[case])
    hkv, lk, mask_rows = options.pop("hkv", HQ), options.pop("lk", LK), options.pop("mask_rows", 0)
    q, k, v = inputs(dtype, hkv=hkv, lk=lk)
    mask = None
    if mask_rows:
        g = torch.Generator().manual_seed(5)
        mask = torch.randn(mask_rows, lk, generator=g).to(dtype)
        mask[..., -1] = float("-inf")  # a key no query sees
    chunked, whole = chunked_and_whole(
        monkeypatch, q, k, v, mask, scale=0.25, enable_gqa=hkv < HQ, **options
    )
    assert chunked.shape == whole.shape == q.shape and chunked.dtype == dtype
    assert torch.isfinite(chunked).all()
    torch.testing.assert_close(chunked, whole, atol=atol, rtol=0)


def reference(q, k, v, scale, softcap, sinks):
    """The formula in float64, one query at a time: query i sees keys 0 .. Lk - Lq + i, its
    scores soft-capped, and its head's sink a logit with no value in the softmax."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    out = torch.empty_like(q)
    for i in range(num_queries):
        seen = num_keys - num_queries + i + 1
        scores = q[..., i : i + 1, :] @ k[..., :seen, :].transpose(-1, -2) * scale
        scores = softcap * torch.tanh(scores / softcap)  # [B, H, 1, seen]
        weights = scores.exp()
        total = weights.sum(-1, keepdim=True) + sinks.exp()  # sinks [H, 1, 1]
        out[..., i : i + 1, :] = weights / total @ v[..., :seen, :]
    return out


def test_chunked_is_the_formula(monkeypatch):
    q, k, v = inputs(torch.float32, hkv=2)
    sinks = head_sinks()
    monkeypatch.setattr(sdpa_module, "SCORES_BUDGET_BYTES", SMALL_BUDGET)
    ours = sdpa(q, k, v, is_causal=True, scale=0.25, enable_gqa=True, softcap=2.0, sinks=sinks)
    ref = reference(q, k, v, 0.25, 2.0, sinks)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
