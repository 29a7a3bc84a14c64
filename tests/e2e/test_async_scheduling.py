"""--async-scheduling end to end: the next step is scheduled and launched before the last one's
tokens are read, and every output is the one steps run one at a time give (HF's greedy tokens,
seeded samples, logprobs, penalties, stops, preemption, aborts), with every block freed."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, model_runner, random_prompts
from tests.fixtures.eager_replay import replay_padded_steps
from tokenbus import SamplingParams, StructuredOutputsParams
from tokenbus.worker.input_batch import StepShape
from tokenbus.worker.model_runner import ModelRunner

MAX_TOKENS = (1, 2, 3, 9, 17, 24)


class LaunchSpy:
    """Counts, at each launch, the steps already in flight, and the decodes fed an unread
    token on the device; notes whether a grammar is in force."""

    def __init__(self, llm, monkeypatch) -> None:
        core = llm.engine.client.engine_core
        self.in_flight_at_launch: list[int] = []
        # Whether, once this step was scheduled, a request's grammar was in force.
        self.grammar_in_force_at_launch: list[bool] = []
        self.unread_inputs = 0
        launch = core.executor.launch_model

        def counted_launch(so):
            self.in_flight_at_launch.append(core.num_steps_in_flight)
            self.grammar_in_force_at_launch.append(not core.scheduler.can_schedule_ahead)
            return launch(so)

        feed = ModelRunner._feed_unread_inputs

        def counted_feed(runner, batch):
            self.unread_inputs += len(batch.unread_inputs)
            return feed(runner, batch)

        monkeypatch.setattr(core.executor, "launch_model", counted_launch)
        monkeypatch.setattr(ModelRunner, "_feed_unread_inputs", counted_feed)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def outputs_of(llm, prompts, params):
    return [
        (list(c.token_ids), c.finish_reason, c.logprobs, c.text)
        for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)
        for c in o.outputs
    ]


def test_greedy_tokens_are_hf_s_with_steps_launched_ahead(tiny_llama_dir, monkeypatch):
    prompts = random_prompts(6, 3, 40, seed=1)
    hf = load_hf(str(tiny_llama_dir))
    want = [hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    llm = make_llm(tiny_llama_dir, async_scheduling=True, max_num_batched_tokens=64)
    spy = LaunchSpy(llm, monkeypatch)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    got = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert max(spy.in_flight_at_launch) == 1  # launched while the last step was unread
    assert spy.unread_inputs > 0
    assert llm.engine.stats_totals["num_prompt_tokens"] == sum(map(len, prompts))
    # The step launched after the last request ended was read too: nothing is held.
    assert llm.engine.client.engine_core.num_steps_in_flight == 0
    assert_engine_clean(llm)


def test_sampling_stops_and_logprobs_match_steps_one_at_a_time(tiny_llama_dir):
    prompts = random_prompts(5, 4, 30, seed=2)
    plain = make_llm(tiny_llama_dir)
    greedy = outputs_of(plain, prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))
    stop_id = greedy[0][0][5]  # the sixth greedy token ends the first request
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.9, seed=7, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=15, n=2),
        SamplingParams(temperature=0.0, max_tokens=10, stop=[greedy[0][3][4:7]]),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True),
    ]
    want = outputs_of(plain, prompts, params)
    ahead = make_llm(tiny_llama_dir, async_scheduling=True)
    assert outputs_of(ahead, prompts, params) == want
    assert want[0][1] == "stop" and len(want[0][0]) == 6
    assert_engine_clean(ahead)


def test_penalties_and_min_tokens_count_the_unread_token(tiny_llama_dir, monkeypatch):
    """Penalties and min_tokens read a request's outputs: the one not read back yet is counted
    on the device, so these requests run ahead too, with the same tokens."""
    prompts = random_prompts(4, 4, 20, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.8, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=1, max_tokens=12, presence_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6),
    ]
    want = outputs_of(make_llm(tiny_llama_dir), prompts, params)
    llm = make_llm(tiny_llama_dir, async_scheduling=True)
    spy = LaunchSpy(llm, monkeypatch)
    assert outputs_of(llm, prompts, params) == want
    assert max(spy.in_flight_at_launch) == 1 and spy.unread_inputs > 0
    assert_engine_clean(llm)


def test_a_grammar_holds_steps_one_at_a_time_only_while_it_runs(tiny_llama_dir, monkeypatch):
    """A request's bitmask for its next step is built from the tokens it accepted: from its
    first step until it ends, every step is read before the next is scheduled. While its
    grammar compiles it is in no step, and the others run ahead."""
    prompts = random_prompts(2, 4, 20, seed=8)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=6,
            structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
        ),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    compiling_steps = 4  # the grammar is "compiled" once this many steps were launched

    def run(async_scheduling: bool):
        llm = make_llm(tiny_llama_dir, async_scheduling=async_scheduling)
        # Compiled once here, the grammar comes from the backend's cache in the timed run.
        outputs_of(llm, prompts[:1], params[:1])
        spy = LaunchSpy(llm, monkeypatch)
        grammars = llm.engine.client.engine_core.scheduler.grammar
        is_ready = grammars.is_ready
        monkeypatch.setattr(
            grammars,
            "is_ready",
            lambda r: len(spy.in_flight_at_launch) >= compiling_steps and is_ready(r),
        )
        return llm, spy, outputs_of(llm, prompts, params)

    want = run(async_scheduling=False)[2]
    llm, spy, got = run(async_scheduling=True)
    assert got == want and got[0][3].isdigit()
    in_flight, in_force = spy.in_flight_at_launch, spy.grammar_in_force_at_launch
    assert 1 in in_flight[1:compiling_steps]  # the plain request runs ahead while it compiles
    # The grammar is in force over its request's steps, one per token it sampled.
    first, num_steps = in_force.index(True), len(got[0][0])
    assert in_force.count(True) == num_steps
    assert in_force[first : first + num_steps] == [True] * num_steps
    # Each step after one that ran the grammar was launched once that one had been read.
    assert all(n == 0 for n, last in zip(in_flight[1:], in_force) if last)
    assert 1 in in_flight[first + num_steps :]  # and the plain request alone runs ahead again
    assert_engine_clean(llm)


def test_preemption_and_chunked_prefill_keep_hf_greedy_tokens(tiny_llama_dir):
    prompts = random_prompts(6, 40, 60, seed=4)
    hf = load_hf(str(tiny_llama_dir))
    want = [hf_greedy(hf, p, 24) for p in prompts]
    # 17 usable blocks for six requests of ~6 blocks each, chunks of 32 tokens.
    llm = make_llm(
        tiny_llama_dir,
        async_scheduling=True,
        num_kv_blocks=18,
        max_model_len=128,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_padded_steps_take_the_unread_token_from_the_device(tiny_llama_dir, monkeypatch):
    """The captured-step path (graph aside, worker/captured_step.py): the unread token is
    copied into the persistent input buffer a graph reads."""
    prompts = random_prompts(3, 5, 30, seed=5)
    hf = load_hf(str(tiny_llama_dir))
    want = [hf_greedy(hf, p, 10) for p in prompts]
    llm = make_llm(tiny_llama_dir, async_scheduling=True, cudagraph_capture_sizes=[1, 2, 4])
    spy = LaunchSpy(llm, monkeypatch)
    replay = replay_padded_steps(llm)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert StepShape(4) in replay.replayed and spy.unread_inputs > 0
    assert model_runner(llm).captured is not None
    assert_engine_clean(llm)


def test_an_abort_while_steps_are_in_flight_frees_everything(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, async_scheduling=True)
    engine = llm.engine
    core = engine.client.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(3, 5, 20, seed=6)):
        engine.add_request(str(i), prompt, params)
    for _ in range(4):
        engine.step()
    assert core.num_steps_in_flight == 1
    engine.abort_request(["0", "2"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"1": 50} and core.num_steps_in_flight == 0
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    "other",
    [
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        dict(kv_transfer_config={"kv_connector": "SharedStorageConnector"}),
    ],
)
def test_async_scheduling_refuses_drafts_and_connectors(tiny_llama_dir, other):
    with pytest.raises(ValueError, match="async_scheduling"):
        make_llm(tiny_llama_dir, async_scheduling=True, **other)


def test_the_engine_process_launches_ahead_too(tiny_llama_dir):
    """The EngineCore in its own process (engine/core_proc.py): a step that only launched
    reports nothing, and the loop keeps stepping until the step in flight is read."""
    prompts = random_prompts(4, 3, 30, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 5, 9, 14)]
    want = outputs_of(make_llm(tiny_llama_dir), prompts, params)
    llm = make_llm(tiny_llama_dir, async_scheduling=True, multiprocess=True)
    try:
        assert outputs_of(llm, prompts, params) == want
        assert outputs_of(llm, prompts[::-1], params) == outputs_of(
            make_llm(tiny_llama_dir), prompts[::-1], params
        )
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_an_id_reused_while_its_old_step_runs_starts_afresh(tiny_llama_dir):
    """A request aborted while a step holding it is in flight, then added again under the
    same id: the old step's token is not the new request's."""
    first, second = random_prompts(2, 5, 20, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def reuse(llm) -> list[int]:
        engine = llm.engine
        engine.add_request("x", first, params)
        for _ in range(3):
            engine.step()
        engine.abort_request(["x"])
        engine.add_request("x", second, params)
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.outputs[0].token_ids]
        return tokens

    want = outputs_of(make_llm(tiny_llama_dir), [second], params)[0][0]
    llm = make_llm(tiny_llama_dir, async_scheduling=True)
    assert llm.engine.client.engine_core.config.scheduler.async_scheduling
    assert reuse(llm) == want
    assert_engine_clean(llm)
