"""The Ray executor: tensor-parallel ranks as actors of a Ray cluster on 127.0.0.1 (started for
the engine, or one started with `ray start --head` and attached to by address)."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.utils.cpu import available_cpus

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'tokenbus[ray]')",
)
RAY_CLI = Path(sys.executable).with_name("ray")
HEAD_START_TIMEOUT_S = 60.0
ATTACH_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


def mp_tokens(path, prompts):
    mp = make_llm(path, tensor_parallel_size=2)
    try:
        return generate_greedy(mp, prompts, 10)
    finally:
        mp.shutdown()


def ray_tokens(path, prompts, **engine_args):
    import ray

    llm = make_llm(path, tensor_parallel_size=2, distributed_executor_backend="ray", **engine_args)
    try:
        # Every node of the cluster, and this driver, on loopback (not eth0's address).
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        tokens = generate_greedy(llm, prompts, 10)
        assert_engine_clean(llm)
        return tokens
    finally:
        llm.shutdown()


@pytest.mark.slow
@needs_ray
def test_ray_gives_the_same_tokens_as_mp():
    path = cached_tiny_model("llama")
    prompts = random_prompts(4, 5, 40, seed=7)
    assert ray_tokens(path, prompts) == mp_tokens(path, prompts)


@pytest.fixture
def ray_head():
    """`ray start --head` on loopback, with its own token, temp dir and process group: its address,
    and the environment a driver needs to attach (the same token)."""
    if not RAY_CLI.exists():
        pytest.skip(f"no ray command next to {sys.executable}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    temp_dir = tempfile.mkdtemp(prefix="tbray")  # short: Ray's socket paths live under it
    driver_env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    driver_env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0"
    )
    # As the executor's module docstring says to start one (the driver finds loopback on its own).
    head_env = dict(driver_env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    head = subprocess.Popen(
        [
            str(RAY_CLI),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            f"--num-cpus={available_cpus()}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        env=head_env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        # `ray start` writes the address file once the head node is up, before blocking.
        while not os.path.exists(os.path.join(temp_dir, "ray_current_cluster")):
            if head.poll() is not None:
                pytest.fail(
                    f"ray start exited {head.returncode}: {head.stderr.read().decode()[-2000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"ray start: no head node within {HEAD_START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", driver_env
    finally:
        # The head's process group: its GCS, raylet, agents and workers (some ignore SIGTERM).
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + (2.0 if sig == signal.SIGTERM else 5.0)
            while time.monotonic() < deadline and _group_alive(head.pid):
                head.poll()
                time.sleep(0.1)
        head.wait(timeout=5)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


ATTACH_SCRIPT = """
import json, sys
from tests.engine.test_ray_executor import ray_tokens
tokens = ray_tokens(sys.argv[1], json.loads(sys.argv[2]), ray_address=sys.argv[3])
print("TOKENS", json.dumps(tokens))
"""


@pytest.mark.slow
@needs_ray
def test_ray_address_attaches_to_a_loopback_head(ray_head):
    """--ray-address 127.0.0.1:PORT, from a fresh process as `tokenbus serve` would be: a process
    that has started a local cluster keeps that cluster's auth mode and token (Ray caches them)."""
    address, env = ray_head
    path = cached_tiny_model("llama")
    prompts = random_prompts(4, 5, 40, seed=7)
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-c", ATTACH_SCRIPT, str(path), json.dumps(prompts), address],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=ATTACH_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    tokens = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert json.loads(tokens[-1].removeprefix("TOKENS ")) == mp_tokens(path, prompts)


@needs_ray
def test_unreachable_ray_address_fails_at_start_up():
    with pytest.raises(
        ValueError, match=r"ray_address '127\.0\.0\.1:1': cannot reach a Ray cluster there"
    ):
        make_llm(
            cached_tiny_model("llama"),
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            ray_address="127.0.0.1:1",
        )


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'tokenbus\[ray\]'"):
        make_llm(cached_tiny_model("llama"), distributed_executor_backend="ray")


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("127.0.0.1:6379", True),
        ("localhost:6379", True),
        ("127.0.1.1:6379", True),
        ("[::1]:6379", True),
        ("10.0.0.5:6379", False),
        ("head.example:6379", False),
        ("auto", False),
        ("ray://127.0.0.1:10001", False),
    ],
)
def test_loopback_is_forced_only_for_loopback_addresses(address, loopback):
    from tokenbus.engine.executor.ray_executor import is_loopback_address

    assert is_loopback_address(address) is loopback
