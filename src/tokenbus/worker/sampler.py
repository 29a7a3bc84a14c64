"""The sampler (L3): logits [B, V] → one token per row, batched, in vLLM V1's order.

    grammar bitmask → raw logprobs → logit bias → min_tokens mask → penalties
    → greedy rows: argmax
    → random rows: temperature → top-k → top-p → min-p → softmax → exponential race

The exponential race picks argmax(probs / q) with q ~ Exp(1), which samples from `probs`
exactly. Seeded rows draw q from their own generator, V numbers per step, so their tokens do
not depend on which other rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus.protocol import TokenLogprobs
from tokenbus.worker.sampling_metadata import SamplingMetadata
from tokenbus.worker.sampling_ops import (
    apply_min_p,
    apply_penalties,
    apply_token_bitmask,
    apply_top_k_top_p,
    exponential_race,
)


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled token, columns 1..n the top-n of the raw distribution."""

    token_ids: torch.Tensor  # Long[B, 1 + n]
    logprobs: torch.Tensor  # Float[B, 1 + n]
    sampled_ranks: torch.Tensor  # Long[B]: 1 + number of tokens with a strictly higher logprob


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # Long[B]
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Samples one token per row. May modify the logits it is given in place."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded random rows draw from this generator (None: torch's default generator).
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits, raw_logprobs = prepare_logits(logits, meta)
        sampled = self._sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(-1)
        if meta.all_greedy:
            return greedy
        random = self._random_sample(logits, meta)
        if greedy is None:
            return random
        return torch.where(meta.is_greedy, greedy, random)

    def _random_sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return exponential_race(sampling_probs(logits, meta), meta.generators, self.generator)


def prepare_logits(
    logits: torch.Tensor, meta: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What every sampler does first, in this order: fp32; the grammar bitmask; the raw
    logprobs when a row asked for them (after the mask, as in vLLM: reported logprobs are those
    of the allowed tokens; before the processors); then the logits processors. May work in
    place on `logits`. Returns (processed logits, raw logprobs or None)."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if meta.grammar_bitmask is not None:
        apply_token_bitmask(logits, meta.grammar_bitmask)
    raw_logprobs = logits.log_softmax(-1) if meta.max_num_logprobs is not None else None
    return apply_logits_processors(logits, meta), raw_logprobs


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Float[B, V]: the distribution random rows draw from (temperature, top-k/p, min-p).
    Works in place on `logits`."""
    if meta.temperature is not None:
        logits = logits.div_(meta.temperature.unsqueeze(1))
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    return logits.softmax(-1)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logit bias, min_tokens mask and penalties: applied to greedy and random rows alike."""
    if meta.logit_bias_indices is not None:
        rows, token_ids = meta.logit_bias_indices
        logits.index_put_((rows, token_ids), meta.logit_bias_values, accumulate=True)
    if meta.min_tokens_indices is not None:
        rows, token_ids = meta.min_tokens_indices
        logits[rows, token_ids] = float("-inf")
    if meta.has_penalties:
        logits = apply_penalties(logits, meta)
    return logits


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor
) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the top-`num_logprobs` of each row."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [B, n]
    sampled_logprobs = logprobs.gather(-1, sampled.unsqueeze(-1))  # [B, 1]
    ranks = (logprobs > sampled_logprobs).sum(-1) + 1  # [B]
    return LogprobsTensors(
        token_ids=torch.cat([sampled.unsqueeze(-1), top_ids], dim=1),  # [B, 1 + n]
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),  # [B, 1 + n]
        sampled_ranks=ranks,
    )


def to_token_logprobs(
    tensors: LogprobsTensors, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """One TokenLogprobs per row (sampled token first, then its own top-n); None where a row
    did not ask for logprobs. `num_logprobs[i]` is row i's `SamplingParams.logprobs`."""
    return unpack_logprobs(pack_logprobs(tensors), num_logprobs)


def pack_logprobs(tensors: LogprobsTensors) -> torch.Tensor:
    """Float64[B, 2 * (1 + n) + 1]: each row's ids, logprobs and rank, to come back in one
    read (ids and ranks, below 2^53, travel exactly as float64)."""
    return torch.cat(
        [
            tensors.token_ids.double(),
            tensors.logprobs.double(),
            tensors.sampled_ranks.double().unsqueeze(1),
        ],
        dim=1,
    )


def unpack_logprobs(
    packed: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """to_token_logprobs of pack_logprobs' rows (read back here)."""
    width = (packed.shape[1] - 1) // 2
    rows = packed.tolist()
    token_ids = [[int(t) for t in row[:width]] for row in rows]
    logprobs = [row[width : 2 * width] for row in rows]
    ranks = [int(row[-1]) for row in rows]
    return [
        None
        if n is None
        else TokenLogprobs(
            token_ids=token_ids[i][: 1 + n], logprobs=logprobs[i][: 1 + n], sampled_rank=ranks[i]
        )
        for i, n in enumerate(num_logprobs)
    ]
