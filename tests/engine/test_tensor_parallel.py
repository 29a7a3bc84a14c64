"""Tensor parallelism through the MultiProcExecutor: one spawned process per rank, gloo with
one thread each, greedy tokens against one rank and HF transformers on the same weights."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams
from tokenbus.config import EngineArgs

MAX_TOKENS = 12


def _spawned_children(proc: psutil.Process) -> list[psutil.Process]:
    """Processes `proc` spawned (the EngineCore, or its ranks), not multiprocessing's tracker."""
    return [p for p in proc.children() if "resource_tracker" not in " ".join(p.cmdline())]


def _first_difference_is_a_near_tie(got, want, logprobs) -> None:
    """Summation order (an all-reduce of partial sums) may flip a near tie; the tokens agree up
    to the first difference, where the other side's token is in our top-5 within 0.1 nats."""
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    position = logprobs[i]
    assert want[i] in position, (i, got, want)
    assert position[got[i]].logprob - position[want[i]].logprob < 0.1, (i, position)


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
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, want, ref in zip(outputs, expected, one_rank):
            got = out.outputs[0].token_ids
            for other in (want, ref):
                if got != other:
                    _first_difference_is_a_near_tie(got, other, out.outputs[0].logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp3_smollm2_matches_transformers():
    """9 query heads and 3 KV heads: three ranks of 3 + 1 (two cores, oversubscribed)."""
    from tokenbus.loader import resolve_model

    llm = make_llm(None, max_model_len=512, tensor_parallel_size=3)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False) for q in ("What is the capital of France?", "List three prime numbers.")]
        source = resolve_model(None)
        hf = load_hf(str(source.path.parent), source.path.name)
        params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, prompt in zip(outputs, prompts):
            got, want = out.outputs[0].token_ids, hf_greedy(hf, prompt, 16)
            if got != want:
                _first_difference_is_a_near_tie(got, want, out.outputs[0].logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 4 attention heads"):
        make_llm(cached_tiny_model("llama"), tensor_parallel_size=3)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2}],
                         ids=["ngram", "self-speculation"])
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

        params = SamplingParams(temperature=0.0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
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
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(cached_tiny_model("llama")),
                                                      tensor_parallel_size=2))
        try:
            workers = _spawned_children(psutil.Process(engine.client.ready.pid))
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
    import httpx

    from tests.fixtures.server import ServerProcess

    server = ServerProcess(str(cached_tiny_model("llama")), "--tensor-parallel-size", "2", log_dir=tmp_path)
    try:
        (engine,) = _spawned_children(psutil.Process(server.proc.pid))
        ranks = _spawned_children(engine)
        assert len(ranks) == 2
        everything = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed_at, status = time.monotonic(), None
        while time.monotonic() - killed_at < 1.0 and status != 503:
            try:
                status = httpx.get(server.url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        assert status == 503, server.log()[-3000:]
        assert "rank 1 died" in server.log() or "rank 1" in server.log()
        server.wait(30)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                  for pid in everything) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in everything), "a rank or the engine outlived the server"
    finally:
        server.close()
