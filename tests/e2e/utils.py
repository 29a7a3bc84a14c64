"""Helpers for end-to-end tests."""

from __future__ import annotations

import random

from tokenbus import LLM


def make_llm(model=None, **engine_args) -> LLM:
    """An LLM with its EngineCore in this process (fast; the multi-process path has its own
    tests)."""
    engine_args.setdefault("seed", 0)
    engine_args.setdefault("multiprocess", False)
    return LLM(None if model is None else str(model), **engine_args)


def model_runner(llm: LLM):
    """The in-process engine's model runner (worker/model_runner.py)."""
    return llm.engine.client.engine_core.executor.worker.runner


def random_prompts(
    num: int,
    min_len: int,
    max_len: int,
    seed: int = 0,
    vocab_low: int = 1000,
    vocab_high: int = 40000,
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_low, vocab_high) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num)
    ]


def generate_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from tokenbus import SamplingParams

    # min_tokens masks EOS as the HF oracle's min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_rows_follow_requests(llm: LLM) -> None:
    """A model with recurrent layers: state rows are held by the requests the worker still
    knows, and only by them (the last step's finished ones too: it is told with the next)."""
    runner = model_runner(llm)
    held = runner.request_states.held_rows
    assert held == {req_id: state.state_row for req_id, state in runner.requests.items()}


def assert_engine_clean(llm: LLM) -> None:
    """No request left anywhere, every KV block free (docs/architecture.md, "Invariants")."""
    assert not llm.engine.has_unfinished_requests()
    llm.engine.client.call_utility("check_integrity")
