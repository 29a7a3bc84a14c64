"""LoRA adapters through a real `tokenbus serve` (tiny model): served as model names, listed by
/v1/models, loaded and unloaded while running, refused with the reason; each adapter's greedy
tokens are HF + PEFT's."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.utils import random_prompts
from tests.fixtures.lora import hf_lora_greedy, hf_lora_model, make_adapter
from tests.fixtures.server import ServerProcess

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-loras")
    return {
        "sql": make_adapter(tiny_llama_dir, root / "sql", seed=1, r=4),
        "poet": make_adapter(
            tiny_llama_dir, root / "poet", seed=2, r=8, targets=("q_proj", "v_proj")
        ),
        "too-wide": make_adapter(tiny_llama_dir, root / "too-wide", seed=3, r=16),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters, tmp_path_factory):
    with ServerProcess(
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"sql={adapters['sql']}",
        "--enable-lora-runtime-updates",
        log_dir=tmp_path_factory.mktemp("lora-server"),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def complete(http, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return http.post("/v1/completions", json={**body, "ignore_eos": True, "return_token_ids": True})


def test_adapters_are_models_with_their_own_greedy_tokens(http, tiny_llama_dir, adapters):
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("sql", "tiny")]
    assert models[1]["root"] == str(adapters["sql"])
    assert http.get("/v1/models/sql").json()["parent"] == "tiny"
    prompt = random_prompts(1, 20, 20, seed=21)[0]
    want_sql = hf_lora_greedy(
        hf_lora_model(str(tiny_llama_dir), adapters["sql"]), prompt, MAX_TOKENS
    )
    want_base = hf_lora_greedy(hf_lora_model(str(tiny_llama_dir), None), prompt, MAX_TOKENS)
    assert want_sql != want_base
    sql = complete(http, "sql", prompt)
    assert sql.status_code == 200, sql.text
    assert sql.json()["model"] == "sql"
    assert sql.json()["choices"][0]["token_ids"] == want_sql
    assert complete(http, "tiny", prompt).json()["choices"][0]["token_ids"] == want_base


def test_adapters_load_and_unload_at_run_time(http, tiny_llama_dir, adapters):
    prompt = random_prompts(1, 12, 12, seed=22)[0]
    assert complete(http, "poet", prompt).status_code == 404
    loaded = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["poet"])}
    )
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'poet' added successfully."
    want = hf_lora_greedy(hf_lora_model(str(tiny_llama_dir), adapters["poet"]), prompt, MAX_TOKENS)
    assert complete(http, "poet", prompt).json()["choices"][0]["token_ids"] == want
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "poet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 200 and chat.json()["model"] == "poet"
    again = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["poet"])}
    )
    assert again.status_code == 400
    assert "has already been loaded" in again.json()["error"]["message"]
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert unloaded.status_code == 200
    assert complete(http, "poet", prompt).status_code == 404
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert gone.status_code == 404
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "sql"]


def test_a_bad_adapter_is_a_400_that_says_why(http, adapters, tmp_path):
    wide = http.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "wide", "lora_path": str(adapters["too-wide"])},
    )
    assert wide.status_code == 400
    assert "rank 16 is above --max-lora-rank 8" in wide.json()["error"]["message"]
    missing = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": str(tmp_path)}
    )
    assert missing.status_code == 400
    assert "no adapter_config.json" in missing.json()["error"]["message"]
    # The server still serves its adapters.
    assert complete(http, "sql", [5, 6, 7]).status_code == 200


def test_lora_flags_are_checked_at_start():
    from tests.api.fake_engine import FakeAsyncLLM
    from tokenbus.api.openai.server import make_serving_context
    from tokenbus.api.openai.server_config import ServerConfig
    from tokenbus.api.openai.serving_lora import parse_lora_module
    from tokenbus.protocol import LoRARequest

    assert parse_lora_module("sql=/a/b") == LoRARequest("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a/b", "base_model_name": "x"}') == (
        LoRARequest("sql", "/a/b")
    )
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_module("sql")
    config = ServerConfig(lora_modules=(LoRARequest("sql", "/a/b"),))
    with pytest.raises(ValueError, match="lora_modules: LoRA adapters need --enable-lora"):
        make_serving_context(FakeAsyncLLM(), config, ["m"])
