"""Sampler: each transform against a hand-computed or log_softmax oracle."""

from __future__ import annotations

import math

import pytest
import torch

from tokenbus.sampling_params import SamplingParams
from tokenbus.worker.sampler import Sampler, apply_logits_processors, to_token_logprobs
from tokenbus.worker.sampling_metadata import SamplingMetadata, SamplingRow
from tokenbus.worker.sampling_ops import (
    apply_min_p,
    apply_token_bitmask,
    apply_top_k_top_p,
    apply_top_p,
)

NEG_INF = float("-inf")


def _row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    *,
    stop_ids: list[int] | None = None,
    **params,
) -> SamplingRow:
    sampling_params = SamplingParams(**params)
    generator = None
    if sampling_params.seed is not None:
        generator = torch.Generator().manual_seed(sampling_params.seed)
    return SamplingRow(
        params=sampling_params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        stop_ids_for_min_tokens=stop_ids or [],
    )


def _sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0):
    meta = SamplingMetadata.build(rows, logits.shape[1], "cpu")
    sampler = Sampler(generator=torch.Generator().manual_seed(seed))
    return sampler(logits.clone(), meta)


def _frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)  # [1, V]


# --- greedy and temperature ------------------------------------------------------------------


def test_greedy_is_argmax_and_takes_the_fast_path():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    rows = [_row(temperature=0.0) for _ in range(5)]
    meta = SamplingMetadata.build(rows, 100, "cpu")
    assert meta.all_greedy and not meta.all_random
    assert meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.output_token_indices is None and meta.logit_bias_indices is None
    assert meta.max_num_logprobs is None
    out = Sampler()(logits.clone(), meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_plain_temperature_batch_keeps_optional_parts_empty():
    meta = SamplingMetadata.build([_row(), _row(temperature=0.5)], 10, "cpu")
    assert meta.all_random and meta.is_greedy is None
    assert meta.temperature is not None and meta.top_k is None and meta.min_p is None
    assert meta.generators == {} and meta.max_top_k == 0


def test_largest_top_k_is_known_on_the_host():
    """The rows' largest k (k >= V and greedy rows are off) comes with the tensor, so top-k
    reads nothing back from the device."""
    rows = [_row(top_k=3), _row(top_k=7), _row(top_k=50), _row(temperature=0.0, top_k=9)]
    meta = SamplingMetadata.build(rows, 10, "cpu")
    assert meta.top_k.tolist() == [3, 7, 10, 10] and meta.max_top_k == 7


def test_low_temperature_converges_to_argmax():
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(1))
    rows = [_row(temperature=1e-3) for _ in range(200)]
    # The argmax leads by >= 0.02 logits in almost every row; at T=1e-3 that is e^-20 odds.
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02
    out = _sample(logits, rows)
    assert torch.equal(out.sampled_token_ids[clear], logits.argmax(-1)[clear])


def test_mixed_greedy_and_random_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5], [0.0, 0.0, 0.0]]).repeat(500, 1)  # [1000, 3]
    rows = [_row(temperature=0.0), _row(temperature=1.0)] * 500
    tokens = _sample(logits, rows).sampled_token_ids
    assert (tokens[0::2] == 1).all()
    assert set(tokens[1::2].tolist()) == {0, 1, 2}


def test_sampling_frequencies_match_softmax():
    probs = [0.5, 0.25, 0.15, 0.1]
    logits = _logits_of(probs).repeat(20000, 1)
    tokens = _sample(logits, [_row()] * 20000).sampled_token_ids
    assert torch.allclose(_frequencies(tokens, 4), torch.tensor(probs), atol=0.015)


# --- top-k / top-p / min-p --------------------------------------------------------------------

PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]  # sorted: 1 (0.4), 3 (0.3), 4 (0.15), 2 (0.1), 0 (0.05)


def _support(masked: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "top_k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 3, 4}), (5, set(range(5)))]
)
def test_top_k_masks_exactly(top_k, expected):
    masked = apply_top_k_top_p(_logits_of(PROBS), torch.tensor([top_k]), None, top_k % 5)
    assert _support(masked[0]) == expected
    # The sort path (taken when top-p is also on) keeps the same set.
    masked = apply_top_k_top_p(
        _logits_of(PROBS), torch.tensor([top_k]), torch.tensor([1.0]), top_k % 5
    )
    assert _support(masked[0]) == expected


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.3, {1}),
        (0.6, {1, 3}),
        (0.8, {1, 3, 4}),
        (0.9, {1, 3, 4, 2}),
        (1.0, set(range(5))),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    masked = apply_top_k_top_p(_logits_of(PROBS), None, torch.tensor([top_p]), 0)
    assert _support(masked[0]) == expected


def test_top_p_applies_to_the_top_k_distribution():
    # After top-k=2 the probabilities are 0.57 and 0.43: top-p 0.5 keeps only id 1, while
    # top-p 0.5 alone (0.4 < 0.5) keeps ids 1 and 3.
    masked = apply_top_k_top_p(_logits_of(PROBS), torch.tensor([2]), torch.tensor([0.5]), 2)
    assert _support(masked[0]) == {1}
    masked = apply_top_k_top_p(_logits_of(PROBS), None, torch.tensor([0.5]), 0)
    assert _support(masked[0]) == {1, 3}


def _top_p_oracle(logits: torch.Tensor, top_p: float) -> set[int]:
    """Walk the tokens from most to least likely until the mass reaches p."""
    probs = logits.softmax(-1).tolist()
    kept, mass = set(), 0.0
    for token_id in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if mass >= top_p:
            break
        kept.add(token_id)
        mass += probs[token_id]
    return kept


def test_top_p_candidate_shortcut_matches_the_full_vocabulary():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 2
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.99, 0.2, 0.7])
    full = apply_top_p(logits.clone(), top_p, num_candidates=300)
    for row, p in enumerate(top_p.tolist()):
        expected = set(range(300)) if p == 1.0 else _top_p_oracle(logits[row], p)
        assert _support(full[row]) == expected
    for num_candidates in (1, 8, 64):  # most rows fall back to the full vocabulary here
        assert torch.equal(apply_top_p(logits.clone(), top_p, num_candidates), full)


@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.0, set(range(5))),
        (0.2, {1, 3, 4, 2}),
        (0.3, {1, 3, 4}),
        (0.5, {1, 3}),
        (1.0, {1}),
    ],
)
def test_min_p_masks_relative_to_the_max(min_p, expected):
    masked = apply_min_p(_logits_of(PROBS), torch.tensor([min_p]))
    assert _support(masked[0]) == expected


def test_rows_use_their_own_settings_and_disabled_rows_are_untouched():
    logits = _logits_of(PROBS).repeat(3, 1)
    top_k, top_p = torch.tensor([1, 5, 2]), torch.tensor([1.0, 0.6, 1.0])
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p, 2)
    assert [_support(row) for row in masked] == [{1}, {1, 3}, {1, 3}]
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([5, 2, 5]), None, 2)
    assert torch.equal(masked[0], logits[0]) and _support(masked[1]) == {1, 3}


@pytest.mark.parametrize(
    "params, expected",
    [
        (dict(top_k=2), {1: 0.4 / 0.7, 3: 0.3 / 0.7}),
        (dict(top_p=0.8), {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85}),
        (dict(min_p=0.3), {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85}),
        (dict(top_k=4, top_p=0.9, min_p=0.3), {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85}),
    ],
)
def test_sampled_support_and_frequencies(params, expected):
    num_rows = 20000
    logits = _logits_of(PROBS).repeat(num_rows, 1)
    tokens = _sample(logits, [_row(**params)] * num_rows).sampled_token_ids
    assert set(tokens.unique().tolist()) == set(expected)
    freqs = _frequencies(tokens, len(PROBS))
    for token_id, prob in expected.items():
        assert freqs[token_id].item() == pytest.approx(prob, abs=0.015)


def test_temperature_is_applied_before_min_p():
    # At T=0.5 the probabilities become ∝ p², i.e. 0.16 : 0.09 : 0.0225 ...; min_p 0.2 then
    # keeps only tokens with p² >= 0.2 * 0.16, i.e. ids 1 and 3.
    num_rows = 4000
    logits = _logits_of(PROBS).repeat(num_rows, 1)
    tokens = _sample(logits, [_row(temperature=0.5, min_p=0.2)] * num_rows).sampled_token_ids
    assert set(tokens.unique().tolist()) == {1, 3}


# --- logit bias, min_tokens, penalties --------------------------------------------------------


def _processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    meta = SamplingMetadata.build(rows, logits.shape[1], "cpu")
    return apply_logits_processors(logits.clone(), meta)


def test_logit_bias_adds_to_the_listed_tokens_only():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    rows = [_row(logit_bias={0: 5.0, 2: -1.5}), _row()]
    expected = torch.tensor([[6.0, 2.0, 1.5, 4.0], [1.0, 2.0, 3.0, 4.0]])
    assert torch.equal(_processed(logits, rows), expected)
    greedy = _sample(logits[:1], [_row(temperature=0, logit_bias={0: 5.0})])
    assert greedy.sampled_token_ids.tolist() == [0]


def test_logit_bias_outside_the_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build([_row(logit_bias={7: 1.0})], 4, "cpu")


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]]).repeat(3, 1)
    rows = [
        _row(output=[1], min_tokens=2, stop_ids=[0, 2], temperature=0),  # 1 < 2: masked
        _row(output=[1, 1], min_tokens=2, stop_ids=[0, 2], temperature=0),  # reached
        _row(output=[], min_tokens=0, stop_ids=[0, 2], temperature=0),  # no min_tokens
    ]
    processed = _processed(logits, rows)
    assert processed[0].tolist() == [NEG_INF, 1.0, NEG_INF, 0.0]
    assert torch.equal(processed[1:], logits[1:])
    assert _sample(logits, rows).sampled_token_ids.tolist() == [1, 0, 0]


def test_repetition_penalty_matches_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 1.0]])
    # Seen: 0 and 1 in the prompt, 3 in the output; 2 and 4 unseen.
    rows = [_row(prompt=[0, 1], output=[3, 3], repetition_penalty=2.0)]
    assert _processed(logits, rows).tolist() == [[1.0, -2.0, 3.0, -4.0, 1.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    rows = [_row(prompt=[0], output=[1, 2, 2, 2], frequency_penalty=0.5, presence_penalty=0.25)]
    # token 1: 1 - 0.5*1 - 0.25; token 2: 1 - 0.5*3 - 0.25; the prompt's token 0 is untouched.
    assert _processed(logits, rows).tolist() == [[1.0, 0.25, -0.75, 1.0]]


def test_all_penalties_together_and_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    rows = [
        _row(
            prompt=[0],
            output=[1, 1],
            repetition_penalty=1.25,
            frequency_penalty=0.1,
            presence_penalty=0.2,
        ),
        _row(prompt=[0], output=[1, 1]),
    ]
    expected_row0 = [2.0 / 1.25, -1.0 * 1.25 - 0.1 * 2 - 0.2, 0.5]
    processed = _processed(logits, rows)
    assert processed[0].tolist() == pytest.approx(expected_row0)
    assert torch.equal(processed[1], logits[1])


# --- seeds ------------------------------------------------------------------------------------


def _seeded_tokens(
    logits_by_row: dict[str, torch.Tensor],
    order: list[str],
    seeds: dict[str, int | None],
    num_steps: int,
) -> dict[str, list[int]]:
    """Run `num_steps` steps of a batch in `order`; seeded rows keep one generator throughout."""
    rows = {name: _row(seed=seeds[name], top_k=50, top_p=0.95) for name in order}
    tokens: dict[str, list[int]] = {name: [] for name in order}
    sampler = Sampler()
    for _ in range(num_steps):
        logits = torch.stack([logits_by_row[name] for name in order])  # [B, V]
        meta = SamplingMetadata.build([rows[name] for name in order], logits.shape[1], "cpu")
        sampled = sampler(logits, meta).sampled_token_ids.tolist()
        for name, token in zip(order, sampled):
            tokens[name].append(token)
    return tokens


def test_seeded_sampling_is_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(3)
    logits_by_row = {name: torch.randn(500, generator=gen) for name in "abxyz"}
    seeds = {"a": 11, "b": 22, "x": 33, "y": None, "z": None}
    alone = _seeded_tokens(logits_by_row, ["a", "b"], seeds, num_steps=8)
    mixed = _seeded_tokens(logits_by_row, ["y", "b", "x", "z", "a"], seeds, num_steps=8)
    assert mixed["a"] == alone["a"] and mixed["b"] == alone["b"]
    assert len(set(alone["a"])) > 1  # really random, not a degenerate distribution
    again = _seeded_tokens(logits_by_row, ["a"], {"a": 12}, num_steps=8)
    assert again["a"] != alone["a"]


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    rows = [
        _row(logprobs=3, temperature=0.7, repetition_penalty=1.5, prompt=[0, 1]),
        _row(logprobs=0, temperature=0.0, logit_bias={5: 10.0}),
        _row(),
        _row(logprobs=5, top_k=4),
    ]
    out = _sample(logits, rows)
    expected = logits.log_softmax(-1)  # of the raw logits: bias and penalties do not count
    lp = out.logprobs
    assert lp.token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6)
    sampled = out.sampled_token_ids
    assert sampled[1].item() == 5
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], expected.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = expected.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    ranks = (expected > expected.gather(1, sampled.unsqueeze(1))).sum(-1) + 1
    assert torch.equal(lp.sampled_ranks, ranks)

    per_row = to_token_logprobs(lp, [row.params.logprobs for row in rows])
    assert per_row[2] is None
    assert len(per_row[0].token_ids) == 4 and len(per_row[1].token_ids) == 1
    assert per_row[3].token_ids == lp.token_ids[3].tolist()
    assert per_row[0].logprobs[0] == pytest.approx(expected[0, sampled[0]].item())
    assert per_row[0].sampled_rank == ranks[0].item()


def test_greedy_token_has_rank_one():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    out = _sample(logits, [_row(temperature=0, logprobs=1)] * 3)
    assert out.logprobs.sampled_ranks.tolist() == [1, 1, 1]
    assert torch.allclose(out.logprobs.logprobs[:, 0], out.logprobs.logprobs[:, 1])


# --- grammar bitmask --------------------------------------------------------------------------


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Bool[B, V] → Int32[B, ceil(V / 32)], bit i of word j = token 32 * j + i."""
    num_rows, vocab_size = allowed.shape
    num_words = math.ceil(vocab_size / 32)
    padded = torch.zeros(num_rows, num_words * 32, dtype=torch.int64)
    padded[:, :vocab_size] = allowed.long()
    words = (padded.view(num_rows, num_words, 32) << torch.arange(32)).sum(-1)  # [B, W]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_apply_token_bitmask_masks_exactly_the_disallowed_tokens():
    gen = torch.Generator().manual_seed(6)
    vocab_size = 70  # not a multiple of 32
    allowed = torch.rand(3, vocab_size, generator=gen) < 0.3
    bitmask = _bitmask(allowed)
    bitmask[1] = -1  # all ones: unconstrained
    logits = torch.randn(3, vocab_size, generator=gen)
    masked = apply_token_bitmask(logits.clone(), bitmask)
    for row in (0, 2):
        assert torch.equal(torch.isfinite(masked[row]), allowed[row])
        assert torch.equal(masked[row][allowed[row]], logits[row][allowed[row]])
    assert torch.equal(masked[1], logits[1])


def test_sampler_samples_only_grammar_allowed_tokens():
    vocab_size = 40
    allowed = torch.zeros(2000, vocab_size, dtype=torch.bool)
    allowed[:, [3, 17, 33]] = True
    meta = SamplingMetadata.build([_row()] * 2000, vocab_size, "cpu")
    meta.grammar_bitmask = _bitmask(allowed)
    tokens = Sampler(torch.Generator().manual_seed(0))(torch.zeros(2000, vocab_size), meta)
    assert set(tokens.sampled_token_ids.unique().tolist()) == {3, 17, 33}


def _dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties' definition over [B, V] tables: the oracle of the (row, token) pairs."""
    counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(rows):
        for token_id in row.output_token_ids:
            counts[i, token_id] += 1
        seen[i, row.prompt_token_ids] = True
    seen |= counts > 0
    params = [row.params for row in rows]
    repetition = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    penalty = torch.where(seen, repetition, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1) * counts
    return logits - torch.tensor([p.presence_penalty for p in params]).unsqueeze(1) * (counts > 0)


@pytest.mark.parametrize("seed", range(3))
def test_penalties_equal_their_dense_definition_bit_for_bit(seed):
    """Repeated ids within and across prompt and output, rows without a penalty, empty rows,
    each penalty alone and together, -inf logits (a min_tokens mask)."""
    gen = torch.Generator().manual_seed(seed)
    vocab_size = 12

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=gen).tolist()

    settings = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-0.4),
        dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
        dict(),
    ]
    rows = [
        _row(ids(int(torch.randint(0, 9, (1,), generator=gen))), ids(n_out), **settings[i % 5])
        for i, n_out in enumerate([0, 1, 7, 12, 3, 0, 9, 5, 2, 11])
    ]
    logits = torch.randn(len(rows), vocab_size, generator=gen) * 3
    logits[2, 5] = NEG_INF
    assert torch.equal(_processed(logits, rows), _dense_penalties(logits, rows))


def test_penalties_of_rows_without_tokens():
    rows = [_row([], [], repetition_penalty=1.5, frequency_penalty=0.5), _row([3], [])]
    logits = torch.randn(2, 6)
    assert torch.equal(_processed(logits, rows), logits)


def _output_counts(meta: SamplingMetadata) -> list[list[int]]:
    """[B, V]: each output pair's count, at its pair (the pairs of one token agree on it)."""
    dense = torch.zeros(meta.num_rows, meta.vocab_size, dtype=torch.long)
    dense[tuple(meta.output_token_indices)] = meta.output_token_counts.long()
    return dense.tolist()


def _prompt_mask(meta: SamplingMetadata) -> list[list[int]]:
    dense = torch.zeros(meta.num_rows, meta.vocab_size, dtype=torch.long)
    dense[tuple(meta.prompt_token_indices)] = 1
    return dense.tolist()


def test_penalty_counts_per_row():
    """Output ids counted per row (repeats add up, an empty row counts nothing); the prompt
    mask marks each prompt id once."""
    rows = [
        _row([1, 2], [3, 3, 4], repetition_penalty=1.2),
        _row([5], [], frequency_penalty=0.5),
        _row([], [4, 0, 4, 4], presence_penalty=0.1),
    ]
    meta = SamplingMetadata.build(rows, 6, "cpu")
    assert _output_counts(meta) == [
        [0, 0, 0, 2, 1, 0],
        [0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 3, 0],
    ]
    assert _prompt_mask(meta) == [
        [0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1],
        [0, 0, 0, 0, 0, 0],
    ]


def test_unread_outputs_count_as_outputs():
    """Async scheduling: a row's output sampled by the last step and not read back yet
    (SamplingRow.num_unread_outputs, its id on the device) counts in the penalties and
    toward min_tokens as if it were in output_token_ids."""
    rows = [
        _row([1], [3], frequency_penalty=0.5),
        _row([5], [2], min_tokens=2, stop_ids=[0], temperature=0),  # 1 + 1 unread: reached
        _row([], [4], min_tokens=2, stop_ids=[0], presence_penalty=0.1),  # 1 < 2: masked
    ]
    rows[0].num_unread_outputs = rows[1].num_unread_outputs = 1
    unread = ([0, 1], torch.tensor([3, 2]))  # rows 0 and 1 sampled 3 and 2
    meta = SamplingMetadata.build(rows, 6, "cpu", unread)
    assert _output_counts(meta) == [
        [0, 0, 0, 2, 0, 0],
        [0, 0, 0, 0, 0, 0],  # no penalty: none of its tokens is listed
        [0, 0, 0, 0, 1, 0],
    ]
    assert meta.min_tokens_indices.tolist() == [[2], [0]]
