"""AsyncLLM: DELTA streams, n>1, stop strings, validation, cancellation, stats, engine death.

The engine is a real EngineCore around a fake worker (tests/fixtures/engine.py) with a word
tokenizer whose token i reads "w{i}". Most tests run it in a thread of this process (fast);
those about processes (cancellation frees blocks across the wire, SIGKILL, shutdown) spawn it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest

from tests.fixtures.engine import (
    expected_tokens,
    fake_engine_core,
    make_fake_setup,
    make_word_tokenizer,
)
from tokenbus.engine.async_llm import AsyncLLM
from tokenbus.engine.client_factory import make_engine_core_client
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.stats import IterationStats
from tokenbus.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def make_async_llm(
    multiprocess: bool = False, step_delay_s: float = 0.0, stat_loggers=None, **setup_kwargs
) -> AsyncLLM:
    setup = make_fake_setup(**setup_kwargs)
    factory = functools.partial(fake_engine_core, step_delay_s=step_delay_s)
    client = make_engine_core_client(
        setup, multiprocess=multiprocess, asyncio_mode=True, engine_factory=factory
    )
    return AsyncLLM(setup, make_word_tokenizer(), client, stat_loggers)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


async def collect(llm: AsyncLLM, request_id: str, prompt: list[int], params: SamplingParams):
    return [out async for out in llm.generate(request_id, prompt, params)]


def words(token_ids: list[int]) -> str:
    return "".join(f"w{t}" for t in token_ids)


class RecordingLogger:
    def __init__(self) -> None:
        self.records: list[tuple[object, IterationStats | None]] = []

    def record(self, scheduler_stats, iteration_stats, engine_index: int = 0) -> None:
        self.records.append((scheduler_stats, iteration_stats))


@pytest.fixture
def llm():
    engine = make_async_llm()
    yield engine
    engine.shutdown()


# ---------------------------------------------------------------------- streams
def test_deltas_add_up_and_only_the_last_is_finished(llm):
    outputs = asyncio.run(collect(llm, "r", [1, 2, 3], greedy(6)))
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert all(len(o.outputs) == 1 and o.outputs[0].index == 0 for o in outputs)
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    assert tokens == expected_tokens([1, 2, 3], 6)
    assert "".join(o.outputs[0].text for o in outputs) == words(tokens)
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert llm.num_unfinished_requests == 0
    asyncio.run(llm.call_utility("check_integrity"))


def test_n_children_stream_deltas_per_index(llm):
    outputs = asyncio.run(collect(llm, "r", [7], greedy(5, n=3)))
    assert all(len(o.outputs) == 1 for o in outputs)
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    for index in range(3):
        mine = [o.outputs[0] for o in outputs if o.outputs[0].index == index]
        assert [t for c in mine for t in c.token_ids] == expected_tokens([7], 5)
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
    asyncio.run(llm.call_utility("check_integrity"))


def test_stop_string_ends_the_request_and_aborts_it_in_the_engine(llm):
    # Tokens 6, 7, 8, 9, ... read "w6w7w8w9"; the engine alone would run 1000 tokens.
    outputs = asyncio.run(collect(llm, "r", [5], greedy(1000, stop=["w9"])))
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "stop" and final.stop_reason == "w9"
    assert "".join(o.outputs[0].text for o in outputs) == "w6w7w8"
    # The abort went out before this call, on the same ordered channel.
    asyncio.run(llm.call_utility("check_integrity"))


def test_invalid_requests_fail_before_the_first_output(llm):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(llm, "long", list(range(1, 99)) * 3, greedy(4))
        with pytest.raises(ValueError, match="out of vocabulary"):
            await collect(llm, "vocab", [1, 100_000], greedy(4, n=2))
        gen = llm.generate("dup", [1], greedy(50))
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(llm, "dup", [1], greedy(4))
        parent = llm.generate("x", [1], greedy(50, n=2))
        await parent.__anext__()
        with pytest.raises(ValueError, match="already in use"):  # the id of x's first child
            await collect(llm, "0_x", [1], greedy(4))
        await parent.aclose()
        await gen.aclose()  # closing early aborts it
        assert first.request_id == "dup"
        await llm.call_utility("check_integrity")

    asyncio.run(main())
    assert llm.num_unfinished_requests == 0


def test_abort_ends_the_stream_with_finish_reason_abort():
    llm = make_async_llm(step_delay_s=0.01)

    async def main():
        outputs = []
        async for out in llm.generate("r", [1], greedy(10_000, n=2)):
            outputs.append(out)
            if len(outputs) == 2:
                await llm.abort("r")
        return outputs

    try:
        outputs = asyncio.run(main())
        assert outputs[-1].finished
        assert sorted(
            o.outputs[0].index for o in outputs if o.outputs[0].finish_reason == "abort"
        ) == [0, 1]
        asyncio.run(llm.call_utility("check_integrity"))
    finally:
        llm.shutdown()


def test_stat_loggers_get_iteration_stats():
    stat_logger = RecordingLogger()
    llm = make_async_llm(stat_loggers=[stat_logger])
    try:
        asyncio.run(collect(llm, "r", [1, 2, 3], greedy(5, n=2)))
    finally:
        llm.shutdown()
    iterations = [it for _, it in stat_logger.records if it is not None]
    assert sum(it.num_generation_tokens for it in iterations) == 10
    assert sum(it.num_prompt_tokens for it in iterations) == 6  # counted once per child
    assert len([t for it in iterations for t in it.time_to_first_tokens_s]) == 2
    assert len([t for it in iterations for t in it.inter_token_latencies_s]) == 8
    finished = [f for it in iterations for f in it.finished_requests]
    assert [f.finish_reason for f in finished] == ["length", "length"]
    for f in finished:
        assert f.num_prompt_tokens == 3 and f.num_generation_tokens == 5
        assert 0.0 <= f.queue_time_s <= f.e2e_latency_s
    assert any(s is not None and s.num_running_reqs == 2 for s, _ in stat_logger.records)


# ---------------------------------------------------------------------- across processes
def test_cancelling_many_generates_frees_the_engine():
    llm = make_async_llm(multiprocess=True, step_delay_s=0.005, num_kv_blocks=256)

    async def consume(i: int, started: asyncio.Event, counts: list[int]):
        async for _ in llm.generate(f"r{i}", [1 + i % 50] * (5 + i), greedy(5000, n=1 + i % 2)):
            counts[i] += 1
            if all(counts):
                started.set()

    async def main():
        started, counts = asyncio.Event(), [0] * 16
        tasks = [asyncio.create_task(consume(i, started, counts)) for i in range(16)]
        await asyncio.wait_for(started.wait(), timeout=30)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert llm.num_unfinished_requests == 0
        await llm.call_utility("check_integrity")  # 0 running, 0 waiting, every block free
        deadline = time.monotonic() + 5  # the gauges the engine sent after the aborts
        while llm.last_scheduler_stats.num_running_reqs or llm.last_scheduler_stats.kv_cache_usage:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # The engine still serves.
        outputs = await collect(llm, "after", [3], greedy(4))
        assert [t for o in outputs for t in o.outputs[0].token_ids] == expected_tokens([3], 4)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert not llm.client.proc.is_alive() and llm.client.proc.exitcode == 0


def test_killed_engine_fails_inflight_generates_promptly():
    llm = make_async_llm(multiprocess=True, step_delay_s=0.01)

    async def main():
        streams = [llm.generate(f"r{i}", [1], greedy(100_000)) for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        os.kill(llm.client.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                async for _ in stream:
                    pass
        assert time.monotonic() - start < 5
        assert llm.errored and isinstance(llm.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            await collect(llm, "new", [1], greedy(2))
        with pytest.raises(EngineDeadError):
            await llm.reset_prefix_cache()

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert not llm.client.proc.is_alive()
