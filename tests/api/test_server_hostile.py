"""A real `tokenbus serve` under hostile and unlucky traffic: heavy requests do not stall others,
a stopped engine is noticed and forgiven, valid odd input works, invalid text is refused early."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time

import httpx
import pytest

from tests.api.test_hostile_traffic import completion, deep_schema
from tests.fixtures.server import ServerProcess

HUGE_PROMPT_BYTES = 9 * 1024 * 1024


@pytest.fixture(scope="module")
def smollm2():
    # Caps raised so that the heavy requests get through to the work they ask for.
    with ServerProcess(
        None,
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "256MiB",
        "--max-schema-depth",
        "100000",
        "--max-schema-bytes",
        "10000000",
        "--max-input-chars",
        "100000000",
    ) as server:
        yield server


async def _gaps_while(url: str, heavy) -> tuple[float, float, list]:
    """Run `heavy` (coroutines) while probing /health every 50 ms and reading a stream; the
    longest /health answer and the longest gap between stream chunks meanwhile."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        done = asyncio.Event()
        health_s: list[float] = []
        gaps: list[float] = []

        async def probe() -> None:
            while not done.is_set():
                start = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                health_s.append(time.monotonic() - start)
                await asyncio.sleep(0.05)

        async def stream() -> None:
            body = {
                "prompt": "Once upon a time",
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            async with http.stream("POST", "/v1/completions", json=body) as response:
                last = time.monotonic()
                async for line in response.aiter_lines():
                    if done.is_set():
                        break
                    if line.startswith("data: "):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now

        streamer = asyncio.create_task(stream())
        prober = asyncio.create_task(probe())
        await asyncio.sleep(1.0)  # the stream is decoding
        gaps.clear()
        results = await asyncio.gather(*(h(http) for h in heavy))
        done.set()
        await prober
        streamer.cancel()
        await asyncio.gather(streamer, return_exceptions=True)
        return max(health_s), max(gaps), results


@pytest.mark.slow
def test_deep_schema_and_huge_tokenize_do_not_delay_health_or_other_streams(smollm2):
    async def deep(http):
        body = {
            "prompt": "{",
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": deep_schema(400)},
            },
        }
        start = time.monotonic()
        response = await http.post("/v1/completions", json=body)
        return response.status_code, time.monotonic() - start

    async def tokenize(http):
        start = time.monotonic()
        response = await http.post(
            "/tokenize", json={"prompt": "hello world " * (HUGE_PROMPT_BYTES // 12)}
        )
        return response.status_code, time.monotonic() - start

    health_s, gap_s, results = asyncio.run(_gaps_while(smollm2.url, [deep, tokenize]))
    (deep_status, deep_s), (tokenize_status, tokenize_s) = results
    # The heavy requests took their time (or were refused by the compile deadline)...
    assert deep_status in (200, 400) and tokenize_status == 200
    assert max(deep_s, tokenize_s) > 1.0, results
    # ...while everything else went on.
    assert health_s < 1.0 and gap_s < 1.0, (health_s, gap_s, results)


@pytest.mark.slow
def test_valid_histories_with_null_content_and_invalid_text(smollm2):
    http = httpx.Client(base_url=smollm2.url, timeout=120)
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    r = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert http.post("/tokenize", json={"messages": history}).status_code == 200
    absent = [
        {"role": "user", "content": "hi"},
        {"role": "assistant"},
        {"role": "user", "content": "again"},
    ]
    assert (
        http.post("/v1/chat/completions", json={"messages": absent, "max_tokens": 2}).status_code
        == 200
    )

    body = '{"prompt": "hi", "max_tokens": 4, "stream": true, "stop": ["\\ud800"]}'
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"

    fan_out = {"prompt": [[1, 2, 3]] * 2000, "n": 16, "max_tokens": 1}
    r = http.post("/v1/completions", json=fan_out)
    assert r.status_code == 400 and "--max-sequences-per-request" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200
    assert "Traceback" not in smollm2.log()


def _long_stream(url: str, result: dict, streaming: threading.Event | None = None) -> None:
    body = {"prompt": "The bus goes", "max_tokens": 480, "ignore_eos": True, "stream": True}
    result["events"] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                result["events"].append(line)
                if streaming is not None:
                    streaming.set()


def test_stopped_engine_turns_health_503_within_the_stall_timeout_and_back(
    tiny_llama_dir, tmp_path
):
    stall_timeout_s = 2.0
    with ServerProcess(
        str(tiny_llama_dir), "--engine-stall-timeout", str(stall_timeout_s), log_dir=tmp_path
    ) as server:
        engine_pid = server.engine_core_pid()
        result: dict = {}
        streaming = threading.Event()
        streamer = threading.Thread(target=_long_stream, args=(server.url, result, streaming))
        streamer.start()
        # Stopped as soon as tokens flow: the engine has work (a fast CPU could otherwise
        # finish the whole stream before a fixed sleep ends).
        assert streaming.wait(30)
        os.kill(engine_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            assert server.wait_for_health(503, stall_timeout_s + 2.0), server.log()[-3000:]
            assert time.monotonic() - stopped_at < stall_timeout_s + 2.0
            r = httpx.post(
                server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10
            )
            assert r.status_code == 503
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert server.wait_for_health(200, 5.0)
        streamer.join(timeout=60)
        assert result["status"] == 200 and result["events"][-1] == "data: [DONE]"
        assert len(result["events"]) > 300  # every token arrived after the stall
        log = server.log()
        assert "completed no step" in log and "stepping again" in log
        assert "most recent call first" in log  # the engine's stacks (faulthandler)


def test_default_queue_bound_answers_503_with_retry_after(tiny_llama_dir, tmp_path):
    with ServerProcess(str(tiny_llama_dir), "--max-num-seqs", "2", log_dir=tmp_path) as server:

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(
                    *(http.post("/v1/completions", json=body) for _ in range(8))
                )

        responses = asyncio.run(flood())
        statuses = sorted(r.status_code for r in responses)
        assert statuses.count(200) >= 4 and 503 in statuses, statuses  # 2 running + 2 waiting
        refused = [r for r in responses if r.status_code == 503]
        assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)


@pytest.mark.slow
def test_pathological_grammars_do_not_deny_structured_output_to_others(tiny_llama_dir, tmp_path):
    from tests.api.test_hostile_traffic import optional_properties_schema
    from tests.structured.test_validator import slow_grammar

    with ServerProcess(
        str(tiny_llama_dir),
        "--grammar-compile-timeout",
        "4",
        "--max-schema-bytes",
        "1000000",
        log_dir=tmp_path,
    ) as server:

        def chat(schema: dict) -> dict:
            return {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "wide", "schema": schema},
                },
            }

        def grammar(spec) -> dict:
            return completion(structured_outputs={"grammar": spec.grammar})

        async def timed(http, body) -> tuple[httpx.Response, float]:
            start = time.monotonic()
            response = await http.post(
                "/v1/chat/completions" if "messages" in body else "/v1/completions", json=body
            )
            return response, time.monotonic() - start

        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                # The first spec starts the checking processes (seconds): not under test.
                await timed(http, completion(structured_outputs={"choice": ["warm"]}))
                wide = [chat(optional_properties_schema(5000, f"t{i}")) for i in range(4)]
                refused = await asyncio.gather(*(timed(http, body) for body in wide))
                slow = [grammar(slow_grammar(1600, f"t{i}")) for i in range(4)]
                killed = await asyncio.gather(*(timed(http, body) for body in slow))
                trivial = await timed(http, completion(structured_outputs={"choice": ["a", "b"]}))
                again = await timed(http, slow[0])
                with pytest.raises(httpx.ReadTimeout):  # a client that gives up at once
                    await http.post(
                        "/v1/completions", json=grammar(slow_grammar(1600, "gone")), timeout=0.5
                    )
                return refused, killed, trivial, again

        refused, killed, trivial, again = asyncio.run(scenario())
        # The client that left took its compile with it, long before the 4 s deadline.
        assert busy_descendants(server.proc.pid) == []
        # Schemas whose compile would take minutes are refused before any compile starts (four
        # 5000-property schemas parsed and costed at once on 2 cores: 1.3 s seen, well under the
        # 4 s a compile would be given)...
        for response, seconds in refused:
            assert response.status_code == 400 and seconds < 2.5
            assert "--max-schema-cost" in response.json()["error"]["message"]
        # ...grammars the estimate cannot see are stopped at the deadline...
        for response, seconds in killed:
            assert response.status_code == 400 and seconds < 5.0
            assert "longer than 4 s" in response.json()["error"]["message"]
        # ...after which structured output answers at once, and nothing compiles on.
        assert trivial[0].status_code == 200 and trivial[1] < 2.0
        assert again[0].status_code == 400 and again[1] < 0.5


def busy_descendants(pid: int, seconds: float = 1.0) -> list[str]:
    """Names of `pid`'s descendant processes that used more than a tenth of a core meanwhile."""
    import psutil

    children = psutil.Process(pid).children(recursive=True)

    def cpu(process) -> float:
        try:
            return sum(process.cpu_times()[:2])
        except psutil.NoSuchProcess:
            return math.inf

    before = {child.pid: cpu(child) for child in children}
    time.sleep(seconds)
    return [
        child.name()
        for child in children
        if cpu(child) != math.inf and cpu(child) - before[child.pid] > 0.1 * seconds
    ]
