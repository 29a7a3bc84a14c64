"""The disk tier as a persistent prefix cache, with real restarts: `tokenbus serve` (SmolLM2,
OffloadingConnector) answers a long system prompt, is stopped (SIGTERM) and started again on
the same directory, and serves that prompt from disk with the same answer."""

from __future__ import annotations

import json

import openai
import pytest

from tests.fixtures.server import ServerProcess

pytestmark = pytest.mark.slow

SYSTEM = "You are a ship's navigator. " + " ".join(
    f"Waypoint {i} lies {i * 7 % 360} degrees from the last." for i in range(40)
)


def _chat(server: ServerProcess, question: str):
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    return client.chat.completions.create(
        model="smollm2",
        max_tokens=16,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )


def test_a_restarted_server_is_warm_from_the_disk_tier(tmp_path):
    config = json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {
                "disk_path": str(tmp_path / "tier"),
                "cpu_bytes": "64MiB",
            },
        }
    )
    args = (
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "256MiB",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        config,
    )
    with ServerProcess(None, *args, log_dir=tmp_path) as server:
        first = _chat(server, "Where is waypoint 3?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert list((tmp_path / "tier").rglob("*.safetensors"))  # flushed on SIGTERM
    with ServerProcess(None, *args, log_dir=tmp_path) as server:
        again = _chat(server, "Where is waypoint 3?")
        prompt_tokens = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
        assert again.choices[0].message.content == first.choices[0].message.content
        other = _chat(server, "And waypoint 9?")  # the same system prompt, another question
        assert other.usage.prompt_tokens_details.cached_tokens >= (prompt_tokens - 20) // 16 * 16
