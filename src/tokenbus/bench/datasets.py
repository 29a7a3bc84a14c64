"""Seeded synthetic workloads (L6)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_token_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Stay clear of the special and byte tokens at the low end of the vocabulary.
    low = min(1000, vocab_size // 4)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def random_workload(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    vocab_size: int,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            random_token_ids(rng, rng.randint(*input_len), vocab_size), rng.randint(*output_len)
        )
        for _ in range(num_prompts)
    ]


def shared_prefix_workload(
    num_prompts: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    vocab_size: int,
) -> list[BenchRequest]:
    """One long shared system prompt followed by a distinct short question per request."""
    rng = random.Random(seed)
    prefix = random_token_ids(rng, prefix_len, vocab_size)
    return [
        BenchRequest(prefix + random_token_ids(rng, question_len, vocab_size), output_len)
        for _ in range(num_prompts)
    ]
