"""Data parallelism: N EngineCore processes behind one load-balancing client."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.server import ServerProcess, spawned_children
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.engine.dp_client import pick_engine
from tokenbus.protocol import SchedulerStats


def test_pick_engine_scores_in_flight_and_waiting():
    idle = SchedulerStats()
    assert pick_engine([0, 0], [None, None]) == 0  # ties: lowest index
    assert pick_engine([3, 1], [idle, idle]) == 1
    # Engine 0 has fewer requests routed but a long reported waiting queue.
    assert pick_engine([2, 4], [SchedulerStats(num_waiting_reqs=2), idle]) == 1
    assert (
        pick_engine(
            [1, 1], [SchedulerStats(kv_cache_usage=0.5), SchedulerStats(kv_cache_usage=0.1)]
        )
        == 1
    )


def test_dp2_spreads_32_requests_and_matches_dp1():
    path = cached_tiny_model("llama")
    prompts = random_prompts(32, 5, 60, seed=11)
    one = make_llm(path, multiprocess=True)
    try:
        want = generate_greedy(one, prompts, 8)
    finally:
        one.shutdown()
    llm = make_llm(path, multiprocess=True, data_parallel_size=2)
    try:
        got = generate_greedy(llm, prompts, 8)
        assert got == want
        routed = llm.engine.client.num_routed
        assert len(routed) == 2 and min(routed) >= 8 and sum(routed) == 32, routed
        assert_engine_clean(llm)  # check_integrity runs on both engines
    finally:
        llm.shutdown()


def test_dp_needs_engine_processes():
    with pytest.raises(
        ValueError, match="data_parallel_size=2 runs each engine in its own process"
    ):
        make_llm(cached_tiny_model("llama"), data_parallel_size=2)  # make_llm: multiprocess=False


def test_server_dp2_metrics_per_engine_and_health_when_one_dies(tmp_path):
    server = ServerProcess(
        str(cached_tiny_model("llama")), "--data-parallel-size", "2", log_dir=tmp_path
    )
    try:
        from concurrent.futures import ThreadPoolExecutor

        def complete(i: int) -> httpx.Response:
            return httpx.post(
                server.url + "/v1/completions",
                timeout=60,
                json={"prompt": f"w{i} w{i + 1} w{i + 2}", "max_tokens": 32, "ignore_eos": True},
            )

        with ThreadPoolExecutor(
            6
        ) as pool:  # at once: in-flight counts spread them over both engines
            for response in pool.map(complete, range(6)):
                assert response.status_code == 200, response.text
        text = httpx.get(server.url + "/metrics", timeout=10).text
        generated = [
            float(
                re.search(
                    rf'^tokenbus:generation_tokens_total{{engine="{e}",[^}}]*}} (\S+)$',
                    text,
                    re.MULTILINE,
                ).group(1)
            )
            for e in (0, 1)
        ]
        assert min(generated) > 0 and sum(generated) == 6 * 32, generated  # both engines worked
        engines = spawned_children(server.proc.pid)
        assert len(engines) == 2
        os.kill(engines[1].pid, signal.SIGKILL)
        assert server.wait_for_health(503, timeout_s=2.0), server.log()[-3000:]
        assert server.wait(30) != 0
    finally:
        server.close()
