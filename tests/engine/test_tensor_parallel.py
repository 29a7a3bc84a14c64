"""Tensor parallelism through the MultiProcExecutor: one spawned process per rank, gloo with
one thread each, greedy tokens against one rank and HF transformers on the same weights."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.e2e.oracle import (
    assert_same_or_near_tie,
    assert_smollm2_chat_matches_hf,
    hf_greedy,
    load_hf,
)
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.server import spawned_children
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams
from tokenbus.engine_args import EngineArgs

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_equals_tp1_and_hf(arch):
    path = cached_tiny_model(arch)
    prompts = random_prompts(4, 5, 40, seed=3)
    hf = load_hf(str(path))
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    single = make_llm(path)
    try:
        one_rank = generate_greedy(single, prompts, MAX_TOKENS)
    finally:
        single.shutdown()
    llm = make_llm(path, tensor_parallel_size=2)
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, want, ref in zip(outputs, expected, one_rank):
            got = out.outputs[0].token_ids
            for other in (want, ref):  # an all-reduce reorders sums: near ties may flip
                assert_same_or_near_tie(got, other, out.outputs[0].logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp3_smollm2_matches_transformers():
    """9 query heads and 3 KV heads: three ranks of 3 + 1 (two cores, oversubscribed)."""
    llm = make_llm(None, max_model_len=512, tensor_parallel_size=3)
    try:
        assert_smollm2_chat_matches_hf(
            llm, ["What is the capital of France?", "List three prime numbers."], 16
        )
    finally:
        llm.shutdown()


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 does not divide the 4 attention heads"
    ):
        make_llm(cached_tiny_model("llama"), tensor_parallel_size=3)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2},
    ],
    ids=["ngram", "self-speculation"],
)
def test_structured_output_and_spec_decode_under_tp(spec):
    path = cached_tiny_model("llama")
    prompts = random_prompts(3, 8, 30, seed=5)
    kwargs = dict(speculative_config=spec)
    single = make_llm(path, **kwargs)
    try:
        want = generate_greedy(single, prompts, MAX_TOKENS)
    finally:
        single.shutdown()
    llm = make_llm(path, tensor_parallel_size=2, **kwargs)
    try:
        got = generate_greedy(llm, prompts, MAX_TOKENS)
        assert got == want
        from tokenbus.sampling_params import StructuredOutputsParams

        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        )
        text = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0].text
        assert text in ("yes", "no")
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_killing_a_rank_fails_every_waiter():
    import asyncio

    from tokenbus.engine.async_llm import AsyncLLM
    from tokenbus.engine.exceptions import EngineDeadError

    async def scenario():
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=str(cached_tiny_model("llama")), tensor_parallel_size=2)
        )
        try:
            workers = spawned_children(engine.client.ready.pid)
            assert len(workers) == 2
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

            async def consume(i):
                async for _ in engine.generate(f"r{i}", [5 + i] * 10, params):
                    pass

            tasks = [asyncio.create_task(consume(i)) for i in range(3)]
            await asyncio.sleep(0.2)
            os.kill(workers[1].pid, signal.SIGKILL)
            started = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert time.monotonic() - started < 5
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "rank 1 died" in str(results[0])
            deadline = time.monotonic() + 1.0
            while engine.errored is False and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.errored
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_killing_a_rank_of_an_idle_server_turns_health_503_within_a_second(tmp_path):
    from tests.fixtures.server import ServerProcess

    server = ServerProcess(
        str(cached_tiny_model("llama")), "--tensor-parallel-size", "2", log_dir=tmp_path
    )
    try:
        (engine,) = spawned_children(server.proc.pid)
        ranks = spawned_children(engine.pid)
        assert len(ranks) == 2
        everything = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        os.kill(ranks[1].pid, signal.SIGKILL)
        assert server.wait_for_health(503, timeout_s=1.0), server.log()[-3000:]
        assert "rank 1 died" in server.log() or "rank 1" in server.log()
        server.wait(30)
        deadline = time.monotonic() + 10
        while (
            any(
                psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                for pid in everything
            )
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            for pid in everything
        ), "a rank or the engine outlived the server"
    finally:
        server.close()


def test_a_rank_that_does_not_answer_is_a_failure_not_a_hang():
    from tokenbus.engine.executor.multiproc import WorkerFailedError

    llm = make_llm(cached_tiny_model("llama"), tensor_parallel_size=2)
    try:
        executor = llm.engine.client.engine_core.executor
        assert executor.collective_rpc("check_health") == [None, None]
        with pytest.raises(
            WorkerFailedError, match=r"ranks \[0, 1\] did not answer within 0 s \(hung\)"
        ):
            executor._gather(0.3)  # nothing was asked: no rank answers
    finally:
        llm.shutdown()
