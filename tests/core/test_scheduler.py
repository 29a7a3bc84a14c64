"""Scheduler tests with fake runner outputs: no model, exact block ids, leak check every time."""

from __future__ import annotations

import pytest

from tests.core.sched_utils import (
    EOS,
    fake_runner_output,
    make_request,
    make_scheduler,
    run_step,
    run_to_completion,
)
from tokenbus.core.request import RequestStatus
from tokenbus.protocol import FinishReason


def test_prefill_then_decode_allocates_blocks_on_boundaries():
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 40, max_tokens=12, ignore_eos=True))
    so, outputs = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 40}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]
    assert so.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    assert outputs[0].new_token_ids == [7]
    # Positions 40..47 fit in block 3 (32..47); position 48 needs block 4.
    for expected_new_blocks in [[]] * 8 + [[4]]:
        so, _ = run_step(sched)
        assert so.num_scheduled_tokens == {"a": 1}
        assert so.scheduled_cached_reqs[0].new_block_ids == expected_new_blocks
    tokens = run_to_completion(sched)
    assert len(tokens["a"]) == 12 - 10


def test_chunked_prefill_drops_partial_samples():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", 80, max_tokens=3, ignore_eos=True))
    chunks, outputs_per_step = [], []
    for _ in range(3):
        so, outputs = run_step(sched)
        chunks.append(so.num_scheduled_tokens["a"])
        outputs_per_step.append(outputs)
    assert chunks == [32, 32, 16]
    assert outputs_per_step[0] == [] and outputs_per_step[1] == []
    assert outputs_per_step[2][0].new_token_ids == [7]
    assert run_to_completion(sched) == {"a": [7, 7]}


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", 10, max_tokens=50, ignore_eos=True))
    run_step(sched)
    sched.add_request(make_request("b", 200, max_tokens=5, ignore_eos=True))
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 63}
    assert list(so.num_scheduled_tokens) == ["a", "b"]  # batch order: running first
    run_to_completion(sched)


def test_long_prefill_threshold_ignored_when_alone():
    sched = make_scheduler(long_prefill_token_threshold=16)
    sched.add_request(make_request("a", 100, max_tokens=1))
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 100}
    run_to_completion(sched)


def test_long_prefill_threshold_applies_with_competition():
    sched = make_scheduler(long_prefill_token_threshold=16)
    sched.add_request(make_request("a", 100, max_tokens=1))
    sched.add_request(make_request("b", 40, max_tokens=1))
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 16, "b": 16}
    run_to_completion(sched)


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(name, 10, max_tokens=3, ignore_eos=True))
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    tokens = run_to_completion(sched)
    assert {k: len(v) for k, v in tokens.items()} == {"a": 2, "b": 2, "c": 3}


def test_waiting_queue_is_strict_head_of_line():
    # 6 usable blocks: "big" needs 5, "a" holds 2 → big cannot fit; "small" must not overtake it.
    sched = make_scheduler(num_blocks=7)
    sched.add_request(make_request("a", 20, max_tokens=20, ignore_eos=True))
    run_step(sched)
    sched.add_request(make_request("big", 70, max_tokens=1))
    sched.add_request(make_request("small", 5, max_tokens=1))
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    run_to_completion(sched)


def test_preemption_evicts_last_admitted_and_resumes():
    # 9 usable blocks of 16 tokens. Two 64-token prompts take 4 blocks each; decoding needs a
    # fifth block each, so the later one (b) is preempted to let a continue.
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 64, max_tokens=40, ignore_eos=True))
    sched.add_request(make_request("b", 64, max_tokens=40, ignore_eos=True))
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 64, "b": 64}
    sched.add_request(make_request("c", 8, max_tokens=2, ignore_eos=True))
    so, _ = run_step(sched)  # a takes block 9, b needs another: none left → b preempted
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}  # nobody admitted in a step that preempted
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [7]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    tokens = run_to_completion(sched)
    # Counted after the two steps above: a had 2 tokens, b 1 (kept across the preemption).
    assert len(tokens["a"]) == 38 and len(tokens["b"]) == 39 and len(tokens["c"]) == 2
    assert sched.num_preemptions_total >= 1


def test_stop_on_eos_and_ignore_eos():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10))
    sched.add_request(make_request("b", 5, max_tokens=3, ignore_eos=True))
    _, outputs = run_step(sched, token=EOS)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["a"].finish_reason == FinishReason.STOP
    assert by_id["b"].finish_reason is None
    assert run_to_completion(sched, token=EOS) == {"b": [EOS, EOS]}


def test_stop_token_ids_set_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, stop_token_ids=[42]))
    _, outputs = run_step(sched, token=42)
    assert outputs[0].finish_reason == FinishReason.STOP and outputs[0].stop_reason == 42
    sched.check_integrity()


def test_min_tokens_holds_off_eos():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, min_tokens=3))
    steps = 0
    while sched.has_unfinished_requests():
        _, outputs = run_step(sched, token=EOS)
        steps += 1
    assert steps == 3
    sched.check_integrity()


def test_max_tokens_and_max_model_len():
    sched = make_scheduler(max_model_len=20)
    sched.add_request(make_request("a", 5, max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("b", 15, max_tokens=None, ignore_eos=True))
    tokens = run_to_completion(sched)
    assert len(tokens["a"]) == 4
    assert len(tokens["b"]) == 5  # 15 prompt + 5 outputs = max_model_len


def test_abort_running_and_waiting_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 30, max_tokens=50, ignore_eos=True))
    sched.add_request(make_request("b", 30, max_tokens=50, ignore_eos=True))
    run_step(sched)
    finished = sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"a", "b"}
    assert sched.schedule().finished_req_ids == {"a", "b"}
    sched.check_integrity()


def test_aborted_during_step_output_is_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=5, ignore_eos=True))
    so = sched.schedule()
    runner_output = fake_runner_output(so, sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(so, runner_output) == []
    sched.check_integrity()


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 10))


def test_spec_tokens_scheduled_and_rejected_ones_rolled_back():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=20, ignore_eos=True))
    run_step(sched)
    sched.requests["a"].spec_token_ids = [1, 2, 3]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    # The target accepted the first draft and sampled one more: 2 tokens, 2 drafts rejected.
    runner_output = fake_runner_output(so, sched, token=lambda _: [1, 9])
    sched.update_from_output(so, runner_output)
    request = sched.requests["a"]
    assert request.num_tokens == 13 and request.num_computed_tokens == 12
    run_to_completion(sched)


def test_no_spec_tokens_for_prefill_chunks():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 20, max_tokens=3, ignore_eos=True))
    sched.requests["a"].spec_token_ids = [1, 2]
    so, _ = run_step(sched)
    assert so.scheduled_spec_decode_tokens == {}
    run_to_completion(sched)


def test_many_requests_random_lengths_no_leak():
    import random

    rng = random.Random(0)
    sched = make_scheduler(
        num_blocks=40, max_num_seqs=8, max_num_batched_tokens=128, long_prefill_token_threshold=48
    )
    for i in range(30):
        sched.add_request(
            make_request(
                str(i), rng.randint(1, 200), max_tokens=rng.randint(1, 40), ignore_eos=True
            )
        )
    tokens = run_to_completion(sched)
    assert len(tokens) == 30


def test_resumed_request_carries_its_outputs():
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 64, max_tokens=40, ignore_eos=True))
    sched.add_request(make_request("b", 64, max_tokens=40, ignore_eos=True))
    run_step(sched)
    run_step(sched)  # b preempted after one output token
    for _ in range(100):
        so, _ = run_step(sched)
        resumed = [r for r in so.scheduled_new_reqs if r.req_id == "b"]
        if resumed:
            break
    assert resumed[0].output_token_ids == [7]
    assert resumed[0].num_computed_tokens == 0
    assert so.num_scheduled_tokens["b"] == 65  # prompt + the output token, recomputed
    run_to_completion(sched)
