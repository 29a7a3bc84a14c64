"""`tokenbus bench serve` against the app on a fake engine, served by uvicorn in a thread."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from tests.api.fake_engine import VOCAB_SIZE, FakeAsyncLLM
from tokenbus.api.openai.server import ServerConfig, ServerState, build_app, make_serving_context
from tokenbus.bench import serve
from tokenbus.bench.datasets import random_workload


@pytest.fixture(scope="module")
def base_url():
    engine = FakeAsyncLLM(token_delay_s=0.002)
    config = ServerConfig(served_model_name="fake")
    state = ServerState(config, make_serving_context(engine, config, ["fake"]), CollectorRegistry())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_bench_serve_end_to_end(base_url, tmp_path):
    workload = random_workload(12, (5, 20), (3, 10), seed=0, vocab_size=VOCAB_SIZE)
    requests = serve.requests_from_workload(workload)
    config = serve.ServeBenchConfig(base_url=base_url, max_concurrency=4, request_rate=200.0)
    summary = asyncio.run(serve.run_benchmark(config, requests))
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["model"] == "fake"
    assert summary["total_input_tokens"] == sum(len(w.prompt_token_ids) for w in workload)
    assert summary["total_output_tokens"] == sum(w.output_len for w in workload)
    assert 1 <= summary["peak_concurrent_requests"] <= 4
    assert summary["mean_ttft_ms"] > 0 and summary["mean_itl_ms"] > 0 and summary["p99_e2el_ms"] > 0
    report = serve.format_report(summary)
    assert report.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     12" in report
    assert "Maximum request concurrency:             4" in report
    for label in ("Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):
        assert label in report


def test_bench_serve_counts_failures(base_url):
    too_long = [serve.ServeRequest([100] * 10, 10, 5), serve.ServeRequest([100] * 10, 10, 100000)]
    config = serve.ServeBenchConfig(base_url=base_url)
    summary = asyncio.run(serve.run_benchmark(config, too_long))
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert "HTTP 400" in summary["errors"][1]


def test_a_token_without_text_still_counts():
    """A chunk whose token has no text yet (half a UTF-8 character, or an id past the
    tokenizer's vocabulary) is a token arrival for TTFT and ITL; finish-only and usage chunks
    are not."""
    assert serve.carries_tokens({"choices": [{"text": "hi", "finish_reason": None}]})
    assert serve.carries_tokens({"choices": [{"text": "", "finish_reason": None}]})
    assert serve.carries_tokens({"choices": [{"text": "!", "finish_reason": "stop"}]})
    assert not serve.carries_tokens({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not serve.carries_tokens({"choices": [], "usage": {"completion_tokens": 3}})


def test_loopback_only_and_bounds():
    for url in ("http://10.1.2.3:8000", "http://example.com", "ftp://127.0.0.1"):
        with pytest.raises(ValueError, match="base_url"):
            serve.ServeBenchConfig(base_url=url)
    serve.ServeBenchConfig(base_url="http://localhost:1")
    serve.ServeBenchConfig(base_url="http://[::1]:1")
    with pytest.raises(ValueError, match="request_rate"):
        serve.ServeBenchConfig(request_rate=0)


def test_poisson_arrivals_are_seeded():
    delays = serve.arrival_delays(2000, rate=10.0, burstiness=1.0, seed=1)
    assert delays == serve.arrival_delays(2000, rate=10.0, burstiness=1.0, seed=1)
    assert math.isclose(sum(delays) / len(delays), 0.1, rel_tol=0.1)
    assert serve.arrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_concurrency_sweep_writes_each_run_and_plots_them(base_url, tmp_path):
    pytest.importorskip("matplotlib")
    from tokenbus.cli.main import main

    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = [
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--num-prompts",
        "8",
        "--input-len",
        "5",
        "20",
        "--output-len",
        "3",
        "8",
        "--vocab-size",
        str(VOCAB_SIZE),
        "--max-concurrency",
        "1",
        "4",
        "--output-json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    assert all(r["completed"] == 8 for r in runs)
    assert png.read_bytes()[:4] == b"\x89PNG"
    # Two engines' saved results side by side.
    side = tmp_path / "side.png"
    assert (
        main(["bench", "plot", str(out), str(out), "--labels", "a", "b", "--out", str(side)]) == 0
    )
    assert side.stat().st_size > 10_000
