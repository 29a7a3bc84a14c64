"""--generation-config / --override-generation-config: where sampling defaults come from."""

from __future__ import annotations

import json

import pytest

from tokenbus.engine.setup import sampling_defaults
from tokenbus.loader.source import DEFAULT_MODEL_SAMPLING, ModelSource, resolve_model


def test_auto_uses_the_models_file_or_the_packaged_models_card(tmp_path):
    hf = ModelSource("hf", tmp_path)
    model_file = {"temperature": 0.6, "top_p": 0.95, "do_sample": True, "eos_token_id": 2}
    assert sampling_defaults("auto", None, hf, model_file) == {"temperature": 0.6, "top_p": 0.95}
    packaged = resolve_model(None)
    assert packaged.is_default_model
    assert (
        sampling_defaults("auto", None, packaged, {})
        == DEFAULT_MODEL_SAMPLING
        == {"temperature": 0.2, "top_p": 0.9}
    )


def test_vllm_path_and_overrides(tmp_path):
    hf = ModelSource("hf", tmp_path)
    assert sampling_defaults("vllm", None, hf, {"temperature": 0.6}) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20, "min_p": 0.05}))
    assert sampling_defaults(str(tmp_path), None, hf, {}) == {"top_k": 20, "min_p": 0.05}
    assert sampling_defaults(str(tmp_path / "generation_config.json"), '{"top_k": 5}', hf, {}) == {
        "top_k": 5,
        "min_p": 0.05,
    }
    assert sampling_defaults("vllm", {"temperature": 0.0}, hf, {}) == {"temperature": 0.0}


@pytest.mark.parametrize(
    "mode, overrides, field",
    [
        ("nowhere/at/all", None, "generation_config"),
        ("vllm", "{not json", "override_generation_config"),
        ("vllm", '{"temprature": 1}', "override_generation_config"),
        ("vllm", "[1]", "override_generation_config"),
    ],
)
def test_bad_settings_name_the_flag(tmp_path, mode, overrides, field):
    with pytest.raises(ValueError, match=field):
        sampling_defaults(mode, overrides, ModelSource("hf", tmp_path), {})


def test_server_and_offline_defaults_follow_the_setting():
    from tests.api.fake_engine import FakeAsyncLLM
    from tests.api.test_openai_app import make_client

    engine = FakeAsyncLLM()
    engine.setup.sampling_defaults = {"temperature": 0.2, "top_p": 0.9}
    with make_client(engine) as client:
        assert (
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code
            == 200
        )
        params = engine.requests[-1][2]
        assert (params.temperature, params.top_p) == (0.2, 0.9)
        body = {"prompt": "hi", "max_tokens": 1, "temperature": 0.7}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert engine.requests[-1][2].temperature == 0.7  # the request's own value wins
