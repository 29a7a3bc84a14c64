"""LFM3 (Lfm3ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random LFM3
(convolutions of 7 taps, a global attention layer turning half of each head on a 1M base, a
sliding one of 20 tokens turning all on 10k, a sigmoid gate per head, sandwich norms
everywhere) gives HF's greedy tokens and logprobs through chunks that cut prompts anywhere,
preemptions (a state rebuilt from token 0) and two tensor-parallel ranks, each holding half the
heads and their gates."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_matches_hf,
    assert_ranks_match_hf,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.e2e.utils import assert_engine_clean, assert_rows_follow_requests, make_llm
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32", max_num_batched_tokens=32)


@pytest.fixture(scope="module", params=["plain", "biases"])
def hf_dir(request):
    if request.param == "biases":  # on in_proj, the conv and out_proj; q/k/v and o_proj
        return cached_tiny_model("lfm3", conv_bias=True, attention_bias=True)
    return cached_tiny_model("lfm3")


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(307, (1, 60))  # past the window of 20


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


def test_the_config_s_layers_and_ropes():
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(cached_tiny_model("lfm3"))))
    assert (arch.architecture, arch.recurrent_layers, arch.conv_kernel) == ("lfm3", (0, 1, 3, 5), 7)
    assert arch.sliding_windows == (None, None, None, None, 20, None)
    assert (arch.rope_theta, arch.rope_local_theta, arch.rotary_dim) == (1e6, 1e4, None)
    assert arch.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.5}
    assert arch.attn_head_gate and not arch.attn_output_gate


def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference):
    llm = make_llm(hf_dir, **ENGINE)
    model = llm.engine.client.engine_core.executor.worker.model
    assert model.state_shapes() == {i: (6, 64) for i in (0, 1, 3, 5)}  # 7 taps: 6 kept
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_tiny_token_budget_and_a_small_pool(hf_dir, prompts, hf_reference):
    """Chunks of 1 to 8 tokens (a window straddles several steps' inputs), then preemptions:
    recomputed requests start again from a zeroed state row."""
    llm = make_llm(
        hf_dir, kv_cache_dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=7
    )
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(llm)
    llm = make_llm(hf_dir, num_kv_blocks=12, max_model_len=80, **ENGINE)  # 2 KV groups
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank holds half the conv channels (and their state), half the heads and gates."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"use_sandwich_norm": False}, "use_sandwich_norm=false is not supported for lfm3"),
        ({"sliding_window": None}, "sliding_window must be a positive integer, got None"),
    ],
)
def test_what_lfm3_cannot_run_is_refused_by_name(tmp_path, change, error):
    import json
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    path = shutil.copytree(cached_tiny_model("lfm3"), tmp_path / "lfm3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=error):
        load_arch(resolve_model(str(path)))


def test_a_rope_entry_without_a_base_takes_the_config_s():
    from pathlib import Path

    from tokenbus.loader.lfm2_config import lfm3_hf_fields

    rope = {"sliding_attention": {"rope_type": "default"}, "full_attention": {}}
    config = dict(
        num_hidden_layers=2, intermediate_size=96, layer_types=["conv", "sliding_attention"],
        rope_parameters=rope, rope_theta=5e5,
    )  # fmt: skip
    fields = lfm3_hf_fields(config, Path("config.json"))
    assert (fields["rope_theta"], fields["rope_local_theta"], fields["rope_scaling"]) == (
        5e5,
        5e5,
        None,
    )
    del config["rope_theta"]  # then Lfm3Config's 1M
    assert lfm3_hf_fields(config, Path("config.json"))["rope_local_theta"] == 1e6
