"""Data parallelism: N EngineCore processes behind one load-balancing client."""

from __future__ import annotations

import os
import random
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.server import ServerProcess, spawned_children
from tests.fixtures.tiny_models import cached_tiny_model


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


@pytest.mark.slow
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


def per_engine(metrics: str, name: str) -> list[float]:
    """A counter's value for engines 0 and 1 of a DP=2 server's /metrics."""
    return [
        float(
            re.search(
                rf'^tokenbus:{name}_total{{engine="{e}",[^}}]*}} (\S+)$', metrics, re.MULTILINE
            ).group(1)
        )
        for e in (0, 1)
    ]


@pytest.mark.slow
def test_server_dp2_prefix_routing_keeps_each_prefix_on_one_engine(tmp_path):
    """Three long prefixes, sent at once, then twice more one after another (both engines idle
    each time): routed by prefix, every repeat finds its prefix cached; in turns, the engines
    alternate, so each prefix finds its engine in exactly one of the two later rounds."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(128)] for _ in range(3)]  # 8 blocks
    max_tokens = 4

    def run(routing: str) -> tuple[list[float], float, float]:
        with ServerProcess(
            str(cached_tiny_model("llama")),
            "--data-parallel-size",
            "2",
            "--data-parallel-routing",
            routing,
            log_dir=tmp_path,
        ) as server:

            def complete(args: tuple[int, list[int]]) -> None:
                turn, prefix = args
                response = httpx.post(
                    server.url + "/v1/completions",
                    timeout=60,
                    json={
                        "prompt": prefix + [7 + turn, 8, 9],  # a suffix of its own each turn
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                    },
                )
                assert response.status_code == 200, response.text

            with ThreadPoolExecutor(3) as pool:
                list(pool.map(complete, [(0, prefix) for prefix in prefixes]))
            for turn in (1, 2):
                for prefix in prefixes:
                    complete((turn, prefix))
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
        requests = [t / max_tokens for t in per_engine(metrics, "generation_tokens")]
        hits = sum(per_engine(metrics, "prefix_cache_hits"))
        queries = sum(per_engine(metrics, "prefix_cache_queries"))
        return requests, hits, hits / queries

    requests, hits, prefix_rate = run("prefix")
    assert sum(requests) == 9 and all(r % 3 == 0 for r in requests), requests  # 3 per prefix
    assert hits == 6 * 128  # every repeat hit its whole prefix
    requests, hits, round_robin_rate = run("round_robin")
    assert requests == [5, 4] and hits == 3 * 128, (requests, hits)
    assert prefix_rate > round_robin_rate, (prefix_rate, round_robin_rate)
