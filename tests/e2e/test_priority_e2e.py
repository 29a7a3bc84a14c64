"""--scheduling-policy priority end to end: preemption under it keeps HF's greedy tokens, the
offline and online front ends pass a request's priority, and a priority under fcfs is refused."""

from __future__ import annotations

import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import MODEL, assert_error, make_client
from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tokenbus import SamplingParams

MAX_TOKENS = 24


def test_preemption_by_priority_keeps_hf_greedy_tokens(tiny_llama_dir):
    prompts = random_prompts(6, 40, 60, seed=4)
    hf = load_hf(str(tiny_llama_dir))
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # 17 usable blocks for six requests of ~6 blocks each: the low priorities give way.
    llm = make_llm(
        tiny_llama_dir, scheduling_policy="priority", num_kv_blocks=18, max_model_len=128
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        priority=[5, 0, 5, 0, 5, 0],
    )
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_a_priority_needs_the_priority_policy(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="priority: 3 needs --scheduling-policy priority"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], priority=[3], use_tqdm=False)
    with pytest.raises(ValueError, match="priority: 2 values for 1 prompts"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], priority=[0, 1], use_tqdm=False)
    assert_engine_clean(llm)


def test_the_api_passes_priority_or_refuses_it_with_a_400():
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "priority": 3}
    fcfs = make_client()
    error = assert_error(fcfs.post("/v1/completions", json=body), 400)
    assert "--scheduling-policy priority" in error["message"]
    engine = FakeAsyncLLM(scheduling_policy="priority")
    client = make_client(engine)
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": -1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert [r.priority for r in engine.engine_requests] == [3, -1]
