"""Batched logits transforms used by the sampler (L3). Each takes logits Float[B, V] and
returns them (usually modified in place); masked tokens become -inf."""

from __future__ import annotations

import torch

from tokenbus.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")
_BITS_PER_WORD = 32
# Most likely tokens a row examines for top-p before falling back to the whole vocabulary.
_TOP_P_CANDIDATES = 1024


def _xgrammar_kernel(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Apply xgrammar's own kernel in place when it is installed (it is an optional extra)."""
    try:
        import xgrammar
    except ImportError:
        return False
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return True


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output: mask the tokens a grammar disallows.

    `bitmask` is Int32[B, ceil(V / 32)]; bit i of word j allows token 32 * j + i. Rows of all
    ones (-1 as int32) are unconstrained and left untouched.
    """
    vocab_size = logits.shape[1]
    if bitmask.shape[1] * _BITS_PER_WORD < vocab_size:
        raise ValueError(
            f"grammar bitmask has {bitmask.shape[1]} words per row, "
            f"too few for a vocabulary of {vocab_size}"
        )
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32)
    if _xgrammar_kernel(logits, bitmask):  # every row at once: all-ones rows stay as they are
        return logits
    rows = (bitmask != -1).any(dim=1).nonzero().squeeze(1)  # [R]: constrained rows
    if rows.numel() == 0:
        return logits
    shifts = torch.arange(_BITS_PER_WORD, dtype=torch.int32, device=logits.device)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # [R, W, 32]; (w, i) → token 32 * w + i
    allowed = bits.flatten(1)[:, :vocab_size].bool()  # [R, W * 32] → [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM) on tokens seen in prompt or output, then OpenAI frequency and
    presence penalties on output tokens: logit -= frequency * count + presence * (count > 0).

    Each reads the logits at its (row, token id) pairs and writes them back: a pair that occurs
    more than once writes the same value each time, so repeats need no dedupe, and the work
    grows with the tokens seen, not with B * V."""
    outputs = meta.output_token_indices  # [2, M]
    if meta.repetition_penalty is not None:
        rows, token_ids = torch.cat([meta.prompt_token_indices, outputs], dim=1)
        values = logits[rows, token_ids]
        penalty = meta.repetition_penalty[rows]
        # Dividing positive logits and multiplying negative ones both make a token less likely.
        logits[rows, token_ids] = torch.where(values > 0, values / penalty, values * penalty)
    if meta.frequency_penalty is not None or meta.presence_penalty is not None:
        rows, token_ids = outputs
        values = logits[rows, token_ids]
        if meta.frequency_penalty is not None:
            values = values - meta.frequency_penalty[rows] * meta.output_token_counts
        if meta.presence_penalty is not None:
            values = values - meta.presence_penalty[rows]
        logits[rows, token_ids] = values
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """Top-k, then top-p on the distribution that top-k left. Rows with k = V / p = 1 are off.
    `max_top_k`: the largest k of the rows with top-k (SamplingMetadata.max_top_k)."""
    if top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th are kept too).

    One torch.topk with the largest k of the rows that use it (`max_k`, known on the host, so
    nothing is read back from the device); no full sort of the vocabulary.
    """
    if max_k <= 0:
        return logits
    uses_top_k = top_k < logits.shape[1]  # [B]: rows without top-k hold V
    top_values = logits.topk(max_k, dim=-1).values  # [B, max_k], descending
    kth_largest = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [B, 1]
    kth_largest.masked_fill_(~uses_top_k.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth_largest, _NEG_INF)


def apply_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, num_candidates: int = _TOP_P_CANDIDATES
) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p: a token
    stays while the tokens ranked above it hold less than p.

    A full sort of the vocabulary costs far more than a topk of 1024 on CPU, so there each
    row first looks at its `num_candidates` most likely tokens and only rows whose candidates
    hold less than p fall back to the full vocabulary. On a GPU every row sorts the whole
    vocabulary: choosing the rows would read a result back from the device.
    """
    vocab_size = logits.shape[1]
    probs = logits.softmax(dim=-1)  # [B, V]
    candidates = vocab_size if logits.is_cuda else min(num_candidates, vocab_size)
    keep, covered = _top_p_keep(probs, top_p, candidates)
    if candidates < vocab_size and not covered.all():
        short = (~covered).nonzero().squeeze(1)  # [S]
        keep[short] = _top_p_keep(probs[short], top_p[short], vocab_size)[0]
    return logits.masked_fill_(~keep, _NEG_INF)


def _top_p_keep(
    probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool[B, V] tokens to keep among each row's top candidates, and Bool[B] rows whose
    candidates hold at least p (only for those is the answer final). p >= 1 keeps all."""
    top_probs, top_ids = probs.topk(num_candidates, dim=-1)  # [B, C], descending
    cumulative = top_probs.cumsum(dim=-1)  # [B, C]
    mass_above = cumulative - top_probs  # [B, C]: mass of the candidates ranked above
    is_off = top_p >= 1.0  # [B]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep.scatter_(1, top_ids, mass_above < top_p.unsqueeze(1))
    keep |= is_off.unsqueeze(1)
    covered = is_off | (cumulative[:, -1] >= top_p)  # [B]
    return keep, covered


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with probability below min_p times the row's largest probability.

    p_i < min_p * p_max  ⇔  l_i < l_max + log(min_p), so no softmax is needed; min_p = 0
    gives a threshold of -inf (off).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [B, 1]
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample one token per row as argmax(probs / q), q ~ Exp(1) i.i.d. — exact sampling.

    Seeded rows draw their V numbers from their own generator, the others from
    `default_generator` (None: torch's default), so a seeded row's token depends only on its
    generator state and its probabilities.
    """
    # q = -log(u), u ~ U[0, 1): faster on CPU than Tensor.exponential_.
    u = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        u.uniform_(generator=default_generator)
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    q = u.log_().neg_()
    # Keep probs / q finite and 0 / q == 0 should a q round to 0.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)
