"""Engine-core clients: request/abort/utility round trips over the wire, waiters woken by engine
death, and the same greedy tokens from every client (in-process, sync MP, asyncio MP)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time

import pytest

from tests.fixtures.engine import expected_tokens, fake_engine_core, make_fake_setup
from tokenbus.engine.async_llm import AsyncLLM
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.mp_client import AsyncMPClient, SyncMPClient
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


@pytest.fixture(scope="module")
def sync_client():
    client = SyncMPClient(
        make_fake_setup(), functools.partial(fake_engine_core, step_delay_s=0.002)
    )
    yield client
    client.shutdown()


def drain_until(client, predicate, timeout_s: float = 10.0):
    """Read outputs until predicate(EngineOutputs) holds; return every EngineOutput read."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outputs = client.get_output()
        seen.extend(outputs.outputs)
        if predicate(outputs):
            return seen
    raise AssertionError("condition not reached")


def test_sync_abort_round_trip(sync_client):
    sync_client.add_request(make_request("long", [1], 100_000))
    sync_client.add_request(make_request("short", [4], 3))
    seen = drain_until(
        sync_client, lambda o: any(x.request_id == "short" and x.finished for x in o.outputs)
    )
    assert [t for o in seen if o.request_id == "short" for t in o.new_token_ids] == expected_tokens(
        [4], 3
    )
    sync_client.abort_requests(["long"])
    # An aborted request sends nothing more; the engine reports its emptied queues.
    drain_until(
        sync_client,
        lambda o: o.scheduler_stats is not None and o.scheduler_stats.num_running_reqs == 0,
    )
    sync_client.call_utility("check_integrity")


def test_sync_utility_results_and_errors(sync_client):
    assert sync_client.call_utility("reset_prefix_cache") is True
    with pytest.raises(ValueError, match="not a public EngineCore method"):
        sync_client.call_utility("_first_scheduled_times")
    with pytest.raises(ValueError, match="not a public EngineCore method"):
        sync_client.call_utility("no_such_method")
    sync_client.add_request(make_request("busy", [1], 100_000))
    with pytest.raises(AssertionError, match="requests left"):  # re-raised as the engine's type
        sync_client.call_utility("check_integrity")
    sync_client.abort_requests(["busy"])
    sync_client.call_utility("check_integrity")  # the engine survived both errors


def test_async_round_trip():
    client = AsyncMPClient(make_fake_setup(), fake_engine_core)

    async def main():
        await client.add_request_async(make_request("a", [1, 2], 4))
        await client.add_request_async(make_request("b", [3], 100_000))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        while len(tokens["a"]) < 4 or not tokens["b"]:
            for out in (await client.get_output_async()).outputs:
                tokens[out.request_id].extend(out.new_token_ids)
        assert tokens["a"] == expected_tokens([1, 2], 4) and tokens["b"]
        await client.abort_requests_async(["b"])
        await client.call_utility_async("check_integrity")
        assert await client.call_utility_async("reset_prefix_cache") is True

    try:
        asyncio.run(main())
    finally:
        client.shutdown()


def test_engine_death_wakes_blocked_sync_waiters():
    # Each step sleeps 1 s, so the utility call waits behind a step when the engine is killed.
    client = SyncMPClient(make_fake_setup(), functools.partial(fake_engine_core, step_delay_s=1.0))
    errors: dict[str, BaseException] = {}

    def wait(name, fn):
        try:
            while True:
                fn()
        except BaseException as exc:
            errors[name] = exc

    try:
        client.add_request(make_request("a", [1], 1000))
        utility = functools.partial(client.call_utility, "has_unfinished_requests")
        threads = [
            threading.Thread(target=wait, args=("output", client.get_output)),
            threading.Thread(target=wait, args=("utility", utility)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        os.kill(client.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        for thread in threads:
            thread.join(timeout=10)
        assert time.monotonic() - start < 5
        assert all(
            isinstance(errors.get(name), EngineDeadError) for name in ("output", "utility")
        ), errors
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            client.add_request(make_request("b", [1], 1))
    finally:
        client.shutdown()


# ---------------------------------------------------------------------- a real (tiny) model
PROMPTS = [[1, 17, 42, 9], [5] * 23, list(range(100, 140)), [7, 7]]


def _llm_tokens(model_dir, multiprocess: bool) -> list[list[int]]:
    from tokenbus import LLM

    llm = LLM(str(model_dir), multiprocess=multiprocess, num_kv_blocks=64, seed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        llm.engine.client.call_utility("check_integrity")
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


def _async_tokens(model_dir, in_process: bool) -> list[list[int]]:
    args = EngineArgs(model=str(model_dir), num_kv_blocks=64, seed=0)
    llm = AsyncLLM.from_engine_args(args, in_process=in_process)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def one(i: int) -> list[int]:
        return [
            t
            async for out in llm.generate(str(i), PROMPTS[i], params)
            for t in out.outputs[0].token_ids
        ]

    async def main():
        tokens = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        await llm.call_utility("check_integrity")
        return list(tokens)

    try:
        return asyncio.run(main())
    finally:
        llm.shutdown()


def test_greedy_tokens_are_the_same_from_every_client(tiny_llama_dir):
    reference = _llm_tokens(tiny_llama_dir, multiprocess=False)
    assert all(len(t) == 8 for t in reference)
    assert _llm_tokens(tiny_llama_dir, multiprocess=True) == reference
    assert _async_tokens(tiny_llama_dir, in_process=False) == reference
    assert _async_tokens(tiny_llama_dir, in_process=True) == reference


def test_server_spawns_the_engine_before_importing_torch(tmp_path, monkeypatch):
    """Cold start: `tokenbus serve` (launch.serve) reaches the engine's spawn without torch (the
    engine imports its own meanwhile) and without the HTTP server's fastapi (imported on a thread
    while the engine starts), and loads the default model's tokenizer from the cache without
    torch too."""
    import subprocess
    import sys

    from tokenbus.loader import load_tokenizer, resolve_model

    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(tmp_path))
    load_tokenizer(resolve_model(None))  # the conversion, saved in the cache
    env = dict(os.environ)
    code = """
import multiprocessing.process, sys
class Spawned(Exception): pass
seen = []
def start(self):
    seen.append(("torch" in sys.modules, "fastapi" in sys.modules))
    raise Spawned
multiprocessing.process.BaseProcess.start = start
import tokenbus.cli.main
from tokenbus.api.openai import launch
from tokenbus.api.openai.server_config import ServerConfig
from tokenbus.engine_args import EngineArgs
try:
    launch.serve(EngineArgs(), ServerConfig(port=0))
except Spawned:
    pass
assert seen == [(False, False)], seen
assert "torch" not in sys.modules and "xgrammar" not in sys.modules
from tokenbus.engine.async_llm import AsyncLLM
seen.clear()
try:
    AsyncLLM.from_engine_args(EngineArgs())
except Spawned:
    pass
assert seen == [(False, False)], seen
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_missing_server_packages_are_refused_before_an_engine_starts(monkeypatch):
    """fastapi and uvicorn are imported while the engine starts; a missing one is named at once,
    before the port is bound or anything is spawned."""
    import importlib.util

    from tokenbus.api.openai import launch
    from tokenbus.api.openai.server_config import ServerConfig

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "uvicorn" else real_find_spec(name, *a, **k),
    )
    monkeypatch.setattr(launch, "bind_socket", lambda *a: pytest.fail("bound a port"))
    monkeypatch.setattr(launch, "create_engine_setup", lambda *a: pytest.fail("set up an engine"))
    with pytest.raises(ModuleNotFoundError, match="needs uvicorn.*pip install uvicorn"):
        launch.serve(EngineArgs(), ServerConfig(port=0))


def test_a_missing_tokenizer_is_refused_before_an_engine_starts():
    """The tokenizer loads beside the starting engine, so a --tokenizer that does not exist is
    refused at setup, before anything is spawned."""
    from tokenbus.engine.setup import create_engine_setup

    with pytest.raises(ValueError, match="tokenizer: 'missing-tok' not found"):
        create_engine_setup(EngineArgs(tokenizer="missing-tok"))
