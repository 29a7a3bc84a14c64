"""Lossless verification of draft tokens in plain torch (L3; any device).

After Leviathan et al. (arXiv 2211.17192), as in vLLM V1's RejectionSampler:

- the target distribution p at every logits row is built exactly as the Sampler builds it
  (grammar bitmask → logit bias → min_tokens → penalties → temperature → top-k → top-p → min-p),
  with each row seeing the earlier drafts as output tokens (see metadata.expand_sampling_rows);
- greedy requests accept draft j while it equals the argmax of row j;
- random requests accept draft x with probability min(1, p(x) / q(x)); q is one-hot on the
  draft when the proposer gives no probabilities (n-gram, greedy draft model);
- at the first rejection the request emits a token from normalised max(0, p − q) (one-hot q:
  p without the draft); when every draft is accepted, a bonus token from p at the last row.

Every request emits its accepted drafts plus exactly one sampled token, so the output follows p
at every position. Randomness per request: its acceptance uniforms, then one exponential race
over the vocabulary (the Sampler draws that same race for a request without drafts). Seeded
requests draw both from their own generator, so their tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus.worker.sampler import LogprobsTensors, gather_logprobs, prepare_logits, sampling_probs
from tokenbus.worker.sampling_metadata import SamplingMetadata
from tokenbus.worker.sampling_ops import exponential_race
from tokenbus.worker.spec_decode.metadata import SpecDecodeMetadata


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]  # [B] accepted drafts, then one recovered or bonus token
    num_accepted: list[int]  # [B] drafts accepted per request
    # R rows; row j of a request describes the token it emitted at position j (rows past its
    # last emitted token are meaningless). None when no request asked for logprobs.
    logprobs: LogprobsTensors | None


class RejectionSampler:
    """Verifies drafts against target logits. May modify the logits it is given in place."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded requests draw from this generator (None: torch's default generator).
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, spec: SpecDecodeMetadata
    ) -> RejectionOutput:
        """logits Float[R, V] and meta (R rows, one per position) -> tokens per request."""
        num_accepted, row_ids, raw_logprobs = self.verify(logits, meta, spec)
        # The step's one read from the device: the accepted counts and every row's token.
        both = torch.cat([num_accepted, row_ids]).tolist()
        num_accepted_list, row_list = both[: spec.num_requests], both[spec.num_requests :]
        token_ids = [
            row_list[first : first + a + 1] for first, a in zip(spec.first_rows, num_accepted_list)
        ]
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs, row_ids)
        return RejectionOutput(token_ids, num_accepted_list, logprobs)

    def verify(
        self, logits: torch.Tensor, meta: SamplingMetadata, spec: SpecDecodeMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The device half, which reads nothing back: (Long[B] drafts accepted per request,
        Long[R] the token each row emits, the raw logprobs [R, V] or None). Row j of a request
        emits its draft j while accepted, then the recovered or bonus token; rows past it are
        meaningless."""
        if logits.shape[0] != spec.num_rows or meta.num_rows != spec.num_rows:
            raise ValueError(
                f"rejection sampler: {logits.shape[0]} logits rows and {meta.num_rows} "
                f"sampling rows for {spec.num_rows} positions"
            )
        logits, raw_logprobs = prepare_logits(logits, meta)
        greedy_ids = None if meta.all_random else logits.argmax(-1)  # [R]
        probs = None if meta.all_greedy else sampling_probs(logits, meta)  # [R, V]: the target's p

        accepted = self._accept(greedy_ids, probs, meta, spec)  # Bool[D]
        num_accepted = _num_leading_accepted(accepted, spec)  # Long[B]
        final_rows = spec.first_rows_t + num_accepted
        # [B]
        final_ids = self._final_tokens(greedy_ids, probs, meta, spec, num_accepted, final_rows)

        row_ids = torch.zeros(spec.num_rows, dtype=torch.long, device=logits.device)  # [R]
        row_ids[spec.draft_rows] = spec.draft_token_ids
        row_ids[final_rows] = final_ids
        return num_accepted, row_ids, raw_logprobs

    def _accept(
        self,
        greedy_ids: torch.Tensor | None,
        probs: torch.Tensor | None,
        meta: SamplingMetadata,
        spec: SpecDecodeMetadata,
    ) -> torch.Tensor:
        """Bool[D]: whether each draft passes its own test (ignoring earlier rejections)."""
        drafts, rows = spec.draft_token_ids, spec.draft_rows
        greedy_ok = None if greedy_ids is None else drafts == greedy_ids[rows]
        if probs is None:
            return greedy_ok
        p = probs[rows, drafts]  # [D] target probability of each draft
        q = (
            torch.ones_like(p)
            if spec.draft_probs is None
            else spec.draft_probs[torch.arange(len(rows), device=p.device), drafts]
        )  # [D]
        u = self._uniforms(meta, spec, p.device)  # [D] ~ U[0, 1)
        # Accept iff u < p / q; written without the division, and a draft with p = 0 never passes.
        random_ok = u * q < p
        if greedy_ok is None:
            return random_ok
        return torch.where(meta.is_greedy[rows], greedy_ok, random_ok)

    def _uniforms(
        self, meta: SamplingMetadata, spec: SpecDecodeMetadata, device: torch.device
    ) -> torch.Tensor:
        """Float[D]: a seeded request's k_i numbers come from its own generator."""
        u = torch.empty(len(spec.draft_rows), device=device)
        seeded = [
            (i, meta.generators[first])
            for i, first in enumerate(spec.first_rows)
            if first in meta.generators and spec.num_draft_tokens[i] > 0
        ]
        if len(seeded) < spec.num_requests:
            u.uniform_(generator=self.generator)
        starts = spec.draft_starts
        for i, generator in seeded:
            u[starts[i] : starts[i] + spec.num_draft_tokens[i]].uniform_(generator=generator)
        return u

    def _final_tokens(
        self,
        greedy_ids: torch.Tensor | None,
        probs: torch.Tensor | None,
        meta: SamplingMetadata,
        spec: SpecDecodeMetadata,
        num_accepted: torch.Tensor,
        final_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Long[B]: the recovered token after a rejection, or the bonus token."""
        greedy_final = None if greedy_ids is None else greedy_ids[final_rows]
        if probs is None:
            return greedy_final
        final_probs = probs[final_rows]  # [B, V], a copy: the race divides it in place
        num_drafts = spec.draft_token_ids.numel()
        if num_drafts > 0:
            # Every request's residual, kept where a draft was rejected: selecting the rejected
            # rows instead (nonzero) would wait on the device for their count. Index of each
            # request's first failing draft in the flat draft list; clamped for requests whose
            # drafts all passed (or that had none), whose residual is dropped.
            rejected = num_accepted < spec.num_draft_tokens_t  # [B]
            failed = (spec.draft_starts_t + num_accepted).clamp_(max=num_drafts - 1)
            residual = _residual(final_probs, spec, failed)
            final_probs = torch.where(rejected.unsqueeze(1), residual, final_probs)
        generators = {
            i: meta.generators[row]
            for i, row in enumerate(spec.first_rows)
            if row in meta.generators
        }
        random_final = exponential_race(final_probs, generators, self.generator)
        if greedy_final is None:
            return random_final
        return torch.where(meta.is_greedy[final_rows], greedy_final, random_final)


def _residual(p: torch.Tensor, spec: SpecDecodeMetadata, failed: torch.Tensor) -> torch.Tensor:
    """max(0, p − q) for each row's failed draft (unnormalised: the race needs no sum).

    Should p − q vanish everywhere (p == q, reachable only through rounding), p itself is used.
    """
    if spec.draft_probs is None:  # one-hot q: p without the rejected draft
        residual = p.clone()
        residual[torch.arange(len(failed), device=p.device), spec.draft_token_ids[failed]] = 0.0
    else:
        residual = (p - spec.draft_probs[failed]).clamp_min_(0.0)
    empty = residual.sum(-1, keepdim=True) <= 0  # [B, 1]
    return torch.where(empty, p, residual)


def _num_leading_accepted(accepted: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
    """Long[B]: per request, how many drafts pass before the first one that fails."""
    padded = torch.zeros(
        spec.num_requests, spec.max_num_draft_tokens + 1, dtype=torch.long, device=accepted.device
    )  # [B, K + 1]; padding counts as a failure
    padded[spec.draft_req_index, spec.draft_pos] = accepted.long()
    return padded.cumprod(dim=1).sum(dim=1)
