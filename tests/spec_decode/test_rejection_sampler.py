"""Rejection sampler: exact greedy verification, and losslessness (the emitted tokens follow the
target distribution) for probabilistic and one-hot draft distributions."""

from __future__ import annotations

import pytest
import torch

from tokenbus.sampling_params import SamplingParams
from tokenbus.worker.sampler import Sampler
from tokenbus.worker.sampling_metadata import SamplingMetadata, SamplingRow
from tokenbus.worker.spec_decode.metadata import SpecDecodeMetadata, expand_sampling_rows
from tokenbus.worker.spec_decode.rejection_sampler import RejectionSampler

V = 16


def _rows(
    num: int, output: list[int] | None = None, seeds: list[int | None] | None = None, **params
) -> list[SamplingRow]:
    rows = []
    for i in range(num):
        seed = seeds[i] if seeds else None
        sp = SamplingParams(seed=seed, **params)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        rows.append(
            SamplingRow(
                params=sp,
                prompt_token_ids=[1, 2],
                output_token_ids=list(output or []),
                generator=gen,
            )
        )
    return rows


def _verify(logits, rows, drafts, draft_probs=None, seed=0, bitmask=None):
    """logits [R, V] for the expanded rows; returns the RejectionOutput."""
    expanded = expand_sampling_rows(rows, drafts)
    meta = SamplingMetadata.build(expanded, logits.shape[1], "cpu")
    meta.grammar_bitmask = bitmask
    spec = SpecDecodeMetadata.build(drafts, "cpu", draft_probs)
    return RejectionSampler(torch.Generator().manual_seed(seed))(logits.clone(), meta, spec)


def _peaked(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_perfect_match_gets_the_bonus_token():
    out = _verify(_peaked([3, 4, 5, 9]), _rows(1, temperature=0.0), [[3, 4, 5]])
    assert out.token_ids == [[3, 4, 5, 9]] and out.num_accepted == [3]


def test_greedy_early_mismatch_emits_the_target_argmax():
    out = _verify(_peaked([3, 7, 5, 9]), _rows(1, temperature=0.0), [[3, 4, 5]])
    assert out.token_ids == [[3, 7]] and out.num_accepted == [1]
    out = _verify(_peaked([2, 7, 5, 9]), _rows(1, temperature=0.0), [[3, 4, 5]])
    assert out.token_ids == [[2]] and out.num_accepted == [0]


def test_multiple_requests_with_and_without_drafts():
    drafts = [[1, 2], [], [6, 6, 6], [8]]
    argmaxes = [1, 2, 3] + [11] + [6, 0, 6, 6] + [8, 12]
    out = _verify(_peaked(argmaxes), _rows(4, temperature=0.0), drafts)
    assert out.token_ids == [[1, 2, 3], [11], [6, 0], [8, 12]]
    assert out.num_accepted == [2, 0, 1, 1]


def test_greedy_applies_penalties_min_tokens_and_bias_per_position_like_plain_decoding():
    """Drafts that equal what step-by-step greedy sampling picks are all accepted."""
    torch.manual_seed(0)
    params = dict(
        temperature=0.0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        min_tokens=3,
        logit_bias={4: 0.7},
    )
    logits = torch.randn(5, V)
    sequential, output = [], [5]
    for row in range(5):
        meta = SamplingMetadata.build(
            [
                SamplingRow(
                    SamplingParams(**params), [1, 2], list(output), stop_ids_for_min_tokens=[0, 4]
                )
            ],
            V,
            "cpu",
        )
        token = int(Sampler()(logits[row : row + 1].clone(), meta).sampled_token_ids[0])
        sequential.append(token)
        output.append(token)
    rows = [SamplingRow(SamplingParams(**params), [1, 2], [5], stop_ids_for_min_tokens=[0, 4])]
    out = _verify(logits, rows, [sequential[:4]])
    assert out.token_ids == [sequential] and out.num_accepted == [4]
    wrong = sequential[:2] + [(sequential[2] + 1) % V, sequential[3]]
    out = _verify(logits, rows, [wrong])
    assert out.token_ids == [sequential[:3]]


def test_bitmask_row_per_position_rejects_a_disallowed_draft():
    logits = _peaked([3, 4, 5])
    bitmask = torch.full((3, 1), -1, dtype=torch.int32)
    bitmask[1] = ~(1 << 4)  # position 1 may not emit token 4
    out = _verify(logits, _rows(1, temperature=0.0), [[3, 4]], bitmask=bitmask)
    assert out.num_accepted == [1] and out.token_ids[0][:1] == [3] and out.token_ids[0][1] != 4


def test_logprobs_describe_each_emitted_position():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    drafts = [[int(logits[0].argmax()), (int(logits[1].argmax()) + 1) % V]]
    out = _verify(logits, _rows(1, temperature=0.0, logprobs=2), drafts)
    assert out.num_accepted == [1]
    raw = logits.log_softmax(-1)
    for pos, token in enumerate(out.token_ids[0]):
        assert int(out.logprobs.token_ids[pos, 0]) == token
        assert float(out.logprobs.logprobs[pos, 0]) == pytest.approx(float(raw[pos, token]))


# --- random: equal to the plain sampler without drafts; seeded determinism ----------------------


def test_request_without_drafts_samples_like_the_plain_sampler():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    rows = _rows(3, seeds=[5, None, 9], temperature=0.8, top_k=6)
    plain = Sampler(torch.Generator().manual_seed(0))(
        logits.clone(),
        SamplingMetadata.build(_rows(3, seeds=[5, None, 9], temperature=0.8, top_k=6), V),
    )
    out = _verify(logits, rows, [[], [], []], seed=0)
    assert [t[0] for t in out.token_ids] == plain.sampled_token_ids.tolist()


def test_seeded_requests_are_deterministic_and_batch_independent():
    gen = torch.Generator().manual_seed(3)
    logits_a = torch.randn(4, V, generator=gen)
    logits_b = torch.randn(3, V, generator=gen)
    drafts_a = [int(logits_a[0].argmax()), int(logits_a[1].argmax()), 0]
    alone = _verify(logits_a, _rows(1, seeds=[11]), [drafts_a], seed=1).token_ids[0]
    again = _verify(logits_a, _rows(1, seeds=[11]), [drafts_a], seed=2).token_ids[0]
    batch_rows = _rows(1, seeds=[None]) + _rows(1, seeds=[11])
    in_batch = _verify(torch.cat([logits_b, logits_a]), batch_rows, [[1, 2], drafts_a], seed=3)
    assert alone == again == in_batch.token_ids[1]


# --- losslessness -------------------------------------------------------------------------------


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Chi-square critical values at significance 1e-4 by degrees of freedom (tables).
_CHI2_CRITICAL = {5: 25.74, 7: 29.88, 15: 42.58}


def _emitted(
    num_requests: int,
    k: int,
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_source: torch.Tensor,
    seed: int,
    **params,
) -> tuple[list[int], list[int]]:
    """Every request: k drafts i.i.d. from draft_source, the same target logits at every row.
    Returns (all emitted tokens, the first emitted token of each request)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(draft_source, num_requests * k, replacement=True, generator=gen)
    drafts = drafts.view(num_requests, k).tolist()  # [N * k] -> [N, k]
    logits = target.log().expand(num_requests * (k + 1), -1)  # [R, V]
    probs = None if draft_probs is None else draft_probs.expand(num_requests * k, -1)
    out = _verify(logits, _rows(num_requests, **params), drafts, probs, seed=seed)
    return [t for ts in out.token_ids for t in ts], [ts[0] for ts in out.token_ids]


def _random_distribution(seed: int, vocab: int, sparsity: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(vocab, generator=gen) ** 2
    probs[torch.rand(vocab, generator=gen) < sparsity] = 0.0
    return probs / probs.sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_approximates_target_distribution(seed):
    """Drafts from q with their probabilities: emitted tokens are i.i.d. samples of p."""
    p = _random_distribution(100 + seed, V)
    q = _random_distribution(200 + seed, V, sparsity=0.3)
    assert 0.5 * (p - q).abs().sum() > 0.25  # q alone would fail the test by far
    tokens, first = _emitted(6000, 3, p, q, q, seed)
    assert _chi_square(tokens, p) < _CHI2_CRITICAL[15]
    assert _chi_square(first, p) < _CHI2_CRITICAL[15]
    # The test has power: the draft distribution itself is rejected.
    assert (
        _chi_square(torch.multinomial(q, len(tokens), True).tolist(), p) > 10 * _CHI2_CRITICAL[15]
    )


@pytest.mark.parametrize("draft_kind", ["copy", "constant"])
def test_one_hot_drafts_preserve_target_distribution(draft_kind):
    """No draft probabilities (n-gram, greedy draft model): q is one-hot on the draft."""
    p = _random_distribution(7, V, sparsity=0.2) ** 2  # peaked: a wrong recovery shows clearly
    p /= p.sum()
    source = (
        p.clone()
        if draft_kind == "copy"
        else torch.nn.functional.one_hot(torch.tensor(int(p.argmin())), V).float()
    )  # an always-rejected draft: p(draft) = 0
    tokens, first = _emitted(6000, 4, p, None, source, seed=5)
    assert _chi_square(tokens, p) < _CHI2_CRITICAL[15]
    assert _chi_square(first, p) < _CHI2_CRITICAL[15]


def test_temperature_and_top_k_apply_to_the_target_distribution():
    vocab = 8
    base = _random_distribution(11, vocab)
    temperature, top_k = 0.7, 6
    processed = (base.log() / temperature).softmax(-1)
    processed[processed.argsort()[: vocab - top_k]] = 0.0
    processed /= processed.sum()
    q = _random_distribution(12, vocab)
    tokens, _ = _emitted(6000, 3, base, q, q, seed=9, temperature=temperature, top_k=top_k)
    assert _chi_square(tokens, processed) < _CHI2_CRITICAL[5]
