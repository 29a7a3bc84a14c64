"""The Ray executor: tensor-parallel ranks as actors of a local Ray cluster on 127.0.0.1."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.tiny_models import cached_tiny_model


def test_ray_gives_the_same_tokens_as_mp():
    path = cached_tiny_model("llama")
    prompts = random_prompts(4, 5, 40, seed=7)
    mp = make_llm(path, tensor_parallel_size=2)
    try:
        want = generate_greedy(mp, prompts, 10)
    finally:
        mp.shutdown()
    llm = make_llm(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert generate_greedy(llm, prompts, 10) == want
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_unreachable_ray_address_fails_at_start_up():
    with pytest.raises(ValueError, match=r"ray_address '127\.0\.0\.1:1': cannot reach a Ray cluster there"):
        make_llm(cached_tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="ray",
                 ray_address="127.0.0.1:1")


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'tokenbus\[ray\]'"):
        make_llm(cached_tiny_model("llama"), distributed_executor_backend="ray")
