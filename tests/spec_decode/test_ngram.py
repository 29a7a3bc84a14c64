"""N-gram prompt lookup against a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbus.worker.spec_decode.ngram import NgramProposer, ngram_propose


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix (min_n..max_n) seen earlier, latest occurrence; copy what followed it,
    token by token, from the context extended by the drafts so far."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        ends = [e for e in range(n - 1, num - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            extended = list(tokens)
            for i in range(k):
                extended.append(extended[ends[-1] + 1 + i])
            return extended[num:]
    return []


def _propose(tokens, min_n=2, max_n=5, k=4):
    return ngram_propose(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_copies_what_followed_the_suffix():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _propose(prompt + [3, 4]) == [5, 6, 7, 8]
    assert _propose(prompt + [3, 4], k=2) == [5, 6]


def test_longest_match_wins_over_a_later_shorter_one():
    # "8 3 4" occurs once (followed by 5); "3 4" alone occurs later (followed by 9).
    tokens = [8, 3, 4, 5, 0, 3, 4, 9, 1, 8, 3, 4]
    assert _propose(tokens, k=1) == [5]
    assert _propose(tokens, max_n=2, k=1) == [9]  # only 2-grams: the latest one


def test_no_match_or_too_short_gives_nothing():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([5, 9, 1, 9]) == []  # only a 1-gram matches; min_n is 2
    assert _propose([5, 9, 1, 9], min_n=1) == [1, 9, 1, 9]
    assert _propose([7]) == []
    assert _propose([1, 2, 1, 2], k=0) == []


def test_periodic_context_continues_the_period():
    assert _propose([1, 2, 1, 2, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert _propose([4, 7, 7, 7], k=3) == [7, 7, 7]


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # small vocabularies: many matches and ties
    tokens = rng.integers(0, vocab, size=int(rng.integers(1, 80))).tolist()
    min_n = int(rng.integers(1, 4))
    max_n = int(rng.integers(min_n, 7))
    k = int(rng.integers(1, 6))
    assert _propose(tokens, min_n, max_n, k) == _reference(tokens, min_n, max_n, k)


def test_proposer_caps_per_request():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    contexts = [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 5, 1, 2], [9, 8, 7]]
    assert proposer.propose_for_contexts(contexts, [10, 1, 10]) == [[3, 4, 5], [3], []]
    assert proposer.propose_for_contexts(contexts[:1], [0]) == [[]]
