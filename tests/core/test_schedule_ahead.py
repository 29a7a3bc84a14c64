"""Scheduling the next step before the last one's tokens are read (async scheduling): the
unread token is a placeholder; fake runner outputs, exact block ids, leak check every time."""

from __future__ import annotations

from tests.core.sched_utils import (
    EOS,
    FakeGrammars,
    fake_runner_output,
    make_request,
    make_scheduler,
)
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.request import RequestStatus
from tokenbus.protocol import FinishReason
from tokenbus.sampling_params import StructuredOutputsParams


def launch(sched):
    """schedule() and the fake output it gets, computed at launch as a runner would."""
    so = sched.schedule()
    return so, fake_runner_output(so, sched)


def test_a_decode_is_scheduled_while_its_input_token_is_unread():
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 47, max_tokens=8, ignore_eos=True))
    so1, out1 = launch(sched)
    a = sched.requests["a"]
    assert so1.num_scheduled_tokens == {"a": 47}
    assert a.num_output_placeholders == 1
    # Before step 1's token is read: position 47 (the unread token) goes into block 3.
    so2, out2 = launch(sched)
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.scheduled_cached_reqs[0].num_computed_tokens == 47
    assert so2.scheduled_cached_reqs[0].new_block_ids == []
    assert a.num_computed_tokens == 48 and a.num_output_placeholders == 2
    assert sched.update_from_output(so1, out1)[0].new_token_ids == [7]
    assert a.num_output_placeholders == 1 and a.num_tokens == 48
    # Position 48 needs block 4; the step is scheduled while step 2's token is unread.
    so3, out3 = launch(sched)
    assert so3.scheduled_cached_reqs[0].new_block_ids == [4]
    assert sched.update_from_output(so2, out2)[0].new_token_ids == [7]
    assert sched.update_from_output(so3, out3)[0].new_token_ids == [7]
    assert a.output_token_ids == [7, 7, 7] and a.num_output_placeholders == 0
    assert a.num_computed_tokens == 49


def test_placeholders_reaching_max_tokens_schedule_nothing_more():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=2, ignore_eos=True))
    so1, out1 = launch(sched)
    so2, out2 = launch(sched)
    assert so2.num_scheduled_tokens == {"a": 1}
    so3, out3 = launch(sched)  # two tokens unread: max_tokens is reached with them
    assert so3.num_scheduled_tokens == {}
    sched.update_from_output(so1, out1)
    [last] = sched.update_from_output(so2, out2)
    assert last.finish_reason == FinishReason.LENGTH and last.new_token_ids == [7]
    assert sched.update_from_output(so3, out3) == []
    assert sched.schedule().finished_req_ids == {"a"}
    sched.check_integrity()


def test_a_request_that_stopped_drops_the_token_of_the_step_after():
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 16, max_tokens=10))
    sched.add_request(make_request("b", 16, max_tokens=3, ignore_eos=True))
    so1 = sched.schedule()
    out1 = fake_runner_output(so1, sched, token=EOS)  # a samples EOS, b too (ignored)
    so2, out2 = launch(sched)  # scheduled before a's EOS is read
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1}
    outputs = sched.update_from_output(so1, out1)
    assert {o.request_id: o.finish_reason for o in outputs} == {"a": FinishReason.STOP, "b": None}
    # a's blocks are free now; its token of step 2 is dropped.
    [b2] = sched.update_from_output(so2, out2)
    assert b2.request_id == "b"
    assert sched.schedule().finished_req_ids == {"a"}
    assert "a" not in sched.requests


def test_preempted_while_its_step_runs_keeps_that_token():
    # 9 usable blocks; two 64-token prompts take 4 each. Scheduling ahead, a's decode takes
    # block 9 and b's needs a tenth: b is preempted while step 1's tokens are unread.
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 64, max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("b", 64, max_tokens=2, ignore_eos=True))
    so1, out1 = launch(sched)
    so2, out2 = launch(sched)
    assert so2.preempted_req_ids == {"b"} and so2.num_scheduled_tokens == {"a": 1}
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    sched.update_from_output(so1, out1)
    assert b.output_token_ids == [7] and b.num_output_placeholders == 0
    sched.update_from_output(so2, out2)
    # Ahead again until every request ends; b resumes with its token and ends at max_tokens.
    in_flight = []
    while sched.has_unfinished_requests() or in_flight:
        if sched.has_unfinished_requests():
            in_flight.append(launch(sched))
        if len(in_flight) == 2 or not sched.has_unfinished_requests():
            sched.update_from_output(*in_flight.pop(0))
    assert b.output_token_ids == [7, 7] and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    sched.schedule()
    sched.check_integrity()


def test_a_preempted_request_whose_unread_token_ends_it_leaves_the_waiting_queue():
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", 64, max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("b", 64, max_tokens=8))
    so1 = sched.schedule()
    out1 = fake_runner_output(so1, sched, token=lambda rid: [EOS if rid == "b" else 7])
    so2, out2 = launch(sched)
    assert so2.preempted_req_ids == {"b"}
    assert [r.request_id for r in sched.waiting] == ["b"]
    [b1] = [o for o in sched.update_from_output(so1, out1) if o.request_id == "b"]
    assert b1.finish_reason == FinishReason.STOP and b1.new_token_ids == [EOS]
    assert not sched.waiting and "b" not in sched.requests
    sched.update_from_output(so2, out2)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().finished_req_ids == {"a", "b"}
    sched.check_integrity()


def test_a_request_under_a_grammar_stops_scheduling_ahead_once_it_runs():
    grammars = FakeGrammars(ready=set())
    sched = make_scheduler(grammar_manager=grammars)
    assert sched.can_schedule_ahead
    grammar = StructuredOutputsParams(regex="[0-9]+")
    sched.add_request(make_request("g", 5, structured_outputs=grammar))
    sched.add_request(make_request("b", 5, repetition_penalty=1.1, min_tokens=2))
    # While g's grammar compiles it is in no step: b runs ahead.
    so1, out1 = launch(sched)
    assert so1.num_scheduled_tokens == {"b": 5}
    assert sched.can_schedule_ahead  # penalties and min_tokens count unread outputs
    # Compiled: g's first step (its bitmask is the grammar's start) is scheduled ahead of
    # step 1's tokens; from then on each step waits for the last one's tokens.
    grammars.ready.add("g")
    so2, out2 = launch(sched)
    assert so2.num_scheduled_tokens == {"b": 1, "g": 5}
    assert not sched.can_schedule_ahead
    sched.update_from_output(so1, out1)
    sched.update_from_output(so2, out2)
    assert sched.requests["g"].output_token_ids == [7]
    assert not sched.can_schedule_ahead
    sched.finish_requests(["g"], RequestStatus.FINISHED_ABORTED)
    assert sched.can_schedule_ahead
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.schedule()
    sched.check_integrity()


def test_a_request_aborted_while_its_grammar_compiles_holds_nobody_back():
    sched = make_scheduler(grammar_manager=FakeGrammars(ready=set()))
    grammar = StructuredOutputsParams(regex="[0-9]+")
    sched.add_request(make_request("g", 5, structured_outputs=grammar))
    assert sched.schedule().num_scheduled_tokens == {}
    assert sched.can_schedule_ahead
    sched.finish_requests(["g"], RequestStatus.FINISHED_ABORTED)
    assert sched.can_schedule_ahead and not sched.has_unfinished_requests()
    sched.schedule()
    sched.check_integrity()


def test_an_embedding_request_preempted_while_its_last_chunk_runs_still_finishes():
    # 8 usable blocks: a and e take 4 each; scheduling ahead, a's decode needs a ninth, so e
    # (admitted last) is preempted while its chunk still runs; its vector comes back after.
    sched = make_scheduler(num_blocks=9)
    sched.add_request(make_request("a", 64, max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("e", 64, max_tokens=1, pooling="last"))
    so1 = sched.schedule()
    out1 = ModelRunnerOutput(req_ids=["a", "e"], sampled_token_ids=[[7], []], pooled=[None, [1.0]])
    so2, out2 = launch(sched)
    assert so2.preempted_req_ids == {"e"} and so2.num_scheduled_tokens == {"a": 1}
    outputs = sched.update_from_output(so1, out1)
    assert [(o.request_id, o.pooled) for o in outputs] == [("a", None), ("e", [1.0])]
    assert not sched.waiting and "e" not in sched.requests
    sched.update_from_output(so2, out2)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.schedule()
    sched.check_integrity()


def test_a_new_request_reusing_an_id_gets_none_of_the_old_one_s_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("x", 5, max_tokens=10, ignore_eos=True))
    so1, out1 = launch(sched)
    so2, out2 = launch(sched)
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("x", 9, max_tokens=2, ignore_eos=True, first_token=300))
    assert sched.update_from_output(so1, out1) == []
    assert sched.update_from_output(so2, out2) == []
    x = sched.requests["x"]
    assert x.output_token_ids == [] and x.num_computed_tokens == 0
    so3, out3 = launch(sched)
    assert so3.num_scheduled_tokens == {"x": 9} and so3.finished_req_ids == {"x"}
    [first] = sched.update_from_output(so3, out3)
    assert first.new_token_ids == [7]
