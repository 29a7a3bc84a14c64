"""Disaggregated prefill/decode with real processes: a prefiller and a decoder `tokenbus serve`
(SmolLM2, P2PConnector) behind `tokenbus proxy`. Greedy answers through the proxy equal the
decoder's own (colocated) answers; the decoder computes only the last prompt token; both sides
end with every KV block free; a dead prefiller is skipped."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from tests.fixtures.server import ServerProcess, wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metric(url: str, name: str) -> float:
    """The sum of a metric's series on a server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = [
        float(m.group(1))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    ]
    return sum(values)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], tmp_path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / "proxy.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenbus",
                "proxy",
                "--prefill",
                *prefill,
                "--decode",
                *decode,
                "--port",
                str(self.port),
                "--health-interval",
                "0.5",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._healthy, 60, 0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    kv_port = _free_port()
    producer = json.dumps(
        {
            "kv_connector": "P2PConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"kv_port": kv_port, "abort_timeout_s": 30},
        }
    )
    consumer = json.dumps({"kv_connector": "P2PConnector", "kv_role": "kv_consumer"})
    common = (
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "128MiB",
        "--enable-prompt-tokens-details",
        "--num-threads",
        "1",
    )
    prefill = ServerProcess(None, *common, "--kv-transfer-config", producer, log_dir=tmp)
    decode = ServerProcess(None, *common, "--kv-transfer-config", consumer, log_dir=tmp)
    proxy = Proxy([prefill.url], [decode.url], tmp)
    try:
        yield prefill, decode, proxy
    finally:
        proxy.close()
        for server in (decode, prefill):
            server.terminate()
            server.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


QUESTIONS = [
    "What is the capital of France?",
    "Write two sentences about the sea. " + "Be vivid and precise. " * 12,
]


def test_through_the_proxy_equals_colocated_and_decodes_only_the_last_token(cluster):
    prefill, decode, proxy = cluster
    via_proxy, direct = _client(proxy.url), _client(decode.url)
    hits_before = _metric(decode.url, "tokenbus:external_prefix_cache_hits_total")
    max_first_prompt = 0
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ours = via_proxy.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        # The decoder got the prompt's KV from the prefiller: all but the last token was cached.
        assert ours.usage.prompt_tokens_details.cached_tokens == ours.usage.prompt_tokens - 1
        max_first_prompt = max(max_first_prompt, ours.usage.prompt_tokens)
        stream = via_proxy.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        reference = direct.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        assert ours.choices[0].message.content == streamed == reference.choices[0].message.content
    completion = via_proxy.completions.create(
        model="smollm2", prompt="The three primary colours are", max_tokens=16, temperature=0
    )
    assert (
        completion.choices[0].text
        == direct.completions.create(
            model="smollm2", prompt="The three primary colours are", max_tokens=16, temperature=0
        )
        .choices[0]
        .text
    )
    # External hits count what the local prefix cache did not have (a repeated prompt, or the
    # default system prompt the chats share, hits locally first).
    assert (
        _metric(decode.url, "tokenbus:external_prefix_cache_hits_total") - hits_before
        >= max_first_prompt - 32
    )
    assert _metric(decode.url, "tokenbus:kv_transfer_loaded_bytes_total") > 0
    # Both sides free every block once the prefiller's sends are done (DONE from the decoder).
    for server in (prefill, decode):
        wait_until(lambda s=server: _metric(s.url, "tokenbus:kv_cache_usage_perc") == 0.0, 20, 0.1)
        assert _metric(server.url, "tokenbus:num_requests_running") == 0


def test_the_prefill_leg_returns_kv_transfer_params(cluster):
    prefill, _, _ = cluster
    body = {
        "model": "smollm2",
        "prompt": "Hello there, how are",
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()[
        "kv_transfer_params"
    ]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert params["remote_num_tokens"] > 0
    # Nobody pulls these: they are freed after abort_timeout_s; a bad params object is a 400.
    bad = dict(body, kv_transfer_params={"a": {"b": {"c": {"d": {"e": 1}}}}})
    assert httpx.post(prefill.url + "/v1/completions", json=bad, timeout=60).status_code == 400


def test_a_dead_prefiller_is_skipped(cluster):
    prefill, decode, proxy = cluster
    prefill.kill()
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ours = _client(proxy.url).chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0
    )
    reference = _client(decode.url).chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0
    )
    assert ours.choices[0].message.content == reference.choices[0].message.content
    wait_until(lambda: _metric(decode.url, "tokenbus:kv_cache_usage_perc") == 0.0, 20, 0.1)
