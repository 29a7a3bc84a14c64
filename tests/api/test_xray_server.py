"""/xray on a real `tokenbus serve` under load: the snapshot's content, one panel per
data-parallel engine, and the page in headless Chromium (a screenshot is kept as an artifact).

Chromium comes from Debian's `chromium` package (the Makefile's test prerequisites install it
where they can); without it the browser test is skipped with that reason.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.fixtures.server import ServerProcess

KEY = "xray-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARTIFACTS = Path(os.environ.get("TOKENBUS_TEST_ARTIFACTS", "/tmp/tokenbus-test-artifacts"))


def load(
    url: str, seconds: float = math.inf, concurrency: int = 4, outcomes: Counter | None = None
) -> threading.Event:
    """Long completions for `seconds` (or until the returned event is set), in the background;
    each reply's status code (or the error's name) is counted in `outcomes`. A failed request
    is retried: only the deadline or the event ends the load."""
    deadline, stop = time.monotonic() + seconds, threading.Event()
    counts = Counter() if outcomes is None else outcomes

    def client(index: int) -> None:
        with httpx.Client(timeout=60, headers=AUTH) as http:
            while time.monotonic() < deadline and not stop.is_set():
                prompt = f"Request {index}: tell me a long story about the sea and the stars."
                body = {"prompt": prompt * (1 + index % 3), "max_tokens": 48, "ignore_eos": True}
                try:
                    counts[str(http.post(url + "/v1/completions", json=body).status_code)] += 1
                except httpx.HTTPError as exc:  # the server is gone (the test ended), or a hiccup
                    counts[type(exc).__name__] += 1
                    time.sleep(0.2)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    return stop


def snapshot(url: str) -> dict:
    response = httpx.get(url + "/xray/snapshot", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(url: str, check, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        data = snapshot(url)
        if check(data) or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(str(tiny_llama_dir), "--api-key", KEY, "--max-num-seqs", "8") as server:
        yield server


def test_the_routes_need_the_key_and_can_be_disabled(server, tiny_llama_dir):
    assert httpx.get(server.url + "/xray/snapshot").status_code == 401
    assert httpx.get(server.url + f"/xray?api_key={KEY}").status_code == 200
    with ServerProcess(str(tiny_llama_dir), "--disable-xray") as plain:
        assert httpx.get(plain.url + "/xray").status_code == 404


def test_snapshot_shows_running_requests_and_their_blocks(server):
    load(server.url, seconds=8)
    data = wait_for(
        server.url, lambda d: any(r["status"] == "running" for r in d["engines"][0]["requests"])
    )
    engine = data["engines"][0]
    running = [r for r in engine["requests"] if r["status"] == "running"]
    assert running, engine
    held = {b for r in running for b in r["block_ids"]}
    import base64

    states = base64.b64decode(engine["block_states"])
    assert states[0] == 0 and held and all(states[b] in (3, 4) for b in held)  # used or shared
    assert engine["steps"] and engine["steps"][-1]["num_reqs"] >= 1
    time.sleep(8.5)  # the load ends; the engine goes idle and every block is free again
    idle = wait_for(server.url, lambda d: d["engines"][0]["num_requests"] == 0)["engines"][0]
    assert idle["num_requests"] == 0 and set(base64.b64decode(idle["block_states"])[1:]) <= {1, 2}


def test_one_panel_per_data_parallel_engine(tiny_llama_dir):
    with ServerProcess(str(tiny_llama_dir), "--data-parallel-size", "2") as server:
        engines = snapshot(server.url)["engines"]
        assert [e["engine_index"] for e in engines] == [0, 1]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (Debian package chromium)")
def test_page_in_a_browser_draws_the_grid_rows_and_a_moving_timeline(server):
    # Load for the whole test, however long: a loaded machine may take minutes over Chromium's
    # first start and its page loads, and the rows and the moving timeline need running
    # requests whenever the page is drawn.
    outcomes: Counter = Counter()
    stop = load(server.url, concurrency=6, outcomes=outcomes)
    try:
        _browse(server, time.monotonic(), outcomes)
    finally:
        stop.set()


def _browse(server, started: float, outcomes: Counter) -> None:
    wait_for(server.url, lambda d: len(d["engines"][0]["steps"]) > 10)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = f"{server.url}/xray?api_key={KEY}"
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"]

    def chromium(*args: str, timeout: float = 120) -> str:
        """Chromium's stdout; "" when it ran past `timeout` (the caller tries again)."""
        try:
            return subprocess.run(
                [*common, *args], capture_output=True, text=True, timeout=timeout
            ).stdout
        except subprocess.TimeoutExpired:
            return ""

    # A first start on a fresh machine builds Chromium's caches (fonts, profile) and can take
    # minutes: pay it on a blank page, outside the page loads below.
    chromium("--dump-dom", "about:blank", timeout=600)

    def rendered() -> tuple[str, int]:
        """The DOM once the page has drawn a snapshot, and the step count it shows."""
        for _ in range(6):  # a loaded machine may need more than one page load's budget
            dom = chromium("--virtual-time-budget=8000", "--dump-dom", page)
            if match := re.search(r'class="muted summary">step (\d+)', dom):
                return dom, int(match.group(1))
        raise AssertionError(f"the page drew no snapshot:\n{dom[:3000]}")

    dom, first = rendered()
    assert 'class="grid"' in dom and 'class="timeline"' in dom
    assert 'class="status running"' in dom  # a request row
    for _ in range(3):  # the timeline moves (a few tries: a draw may show an older snapshot)
        time.sleep(1.5)
        again = rendered()[1]
        if again > first:
            break
    assert again > first, (
        f"step {again} after {first}, {time.monotonic() - started:.0f} s in; "
        f"load replies so far: {dict(outcomes)}; the engine now: {_engine_summary(server.url)}"
    )
    shot = ARTIFACTS / "xray.png"
    for _ in range(3):  # as above: a page load may end before the first snapshot is drawn
        chromium("--virtual-time-budget=6000", f"--screenshot={shot}", page)
        if (
            shot.exists() and shot.stat().st_size > 20_000
        ):  # a drawn page; "connecting…" alone is ~10 kB
            break
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000


def _engine_summary(url: str) -> dict:
    engine = snapshot(url)["engines"][0]
    return {
        "step_index": engine["step_index"],
        "num_requests": engine["num_requests"],
        "statuses": [r["status"] for r in engine["requests"]],
    }
