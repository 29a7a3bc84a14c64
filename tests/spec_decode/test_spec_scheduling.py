"""Scheduler side of speculative decoding, without a model: stats, lookahead slots, drafts cut
by the grammar, drafts dropped past the budget or max_model_len, a stop inside accepted drafts."""

from __future__ import annotations

from tests.core.sched_utils import (
    BLOCK_SIZE,
    FakeGrammars,
    fake_runner_output,
    make_request,
    make_scheduler,
    run_step,
    run_to_completion,
)
from tokenbus.config import SchedulerConfig
from tokenbus.core.kv import KVCacheManager
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.sched.scheduler import Scheduler


def _decoding(sched, req_id="a", num_prompt=10, **params):
    params.setdefault("max_tokens", 50)
    params.setdefault("ignore_eos", True)
    sched.add_request(make_request(req_id, num_prompt, **params))
    run_step(sched)  # prefill; the request now decodes
    return sched.requests[req_id]


def _verify(sched, drafts, sampled, next_drafts=None):
    """One step verifying `drafts`; the runner returns `sampled` and proposes `next_drafts`."""
    sched.requests["a"].spec_token_ids = list(drafts)
    so = sched.schedule()
    out = ModelRunnerOutput(
        req_ids=list(so.num_scheduled_tokens),
        sampled_token_ids=[list(sampled)],
        spec_token_ids=None if next_drafts is None else [list(next_drafts)],
    )
    return so, sched.update_from_output(so, out)


def test_stats_count_drafts_and_accepted_per_position():
    sched = make_scheduler()
    _decoding(sched)
    _verify(sched, [1, 2, 3], [1, 2, 9])
    stats = sched.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (
        1,
        3,
        2,
    )
    assert stats.spec_accepted_per_pos == [1, 1, 0]
    run_step(sched)  # a step without drafts reports none
    stats = sched.make_stats()
    assert (stats.spec_num_drafts, stats.spec_accepted_per_pos) == (0, [])
    run_to_completion(sched)


def test_next_drafts_stored_and_all_accepted_gives_the_bonus():
    sched = make_scheduler()
    request = _decoding(sched)
    so, outputs = _verify(sched, [4, 5], [4, 5, 6], next_drafts=[7, 8])
    assert outputs[0].new_token_ids == [4, 5, 6]
    assert request.num_computed_tokens == request.num_tokens - 1  # every fed token was kept
    assert request.spec_token_ids == [7, 8]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [7, 8]}
    sched.update_from_output(so, fake_runner_output(so, sched))
    run_to_completion(sched)


def test_lookahead_slots_reserved_for_draft_model_kv():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024)
    sched = Scheduler(
        config, KVCacheManager(50, BLOCK_SIZE, enable_caching=False), num_lookahead_tokens=4
    )
    sched.add_request(make_request("a", 14, max_tokens=5, ignore_eos=True))
    so, _ = run_step(sched)
    # 14 prompt tokens + 4 lookahead slots need 2 blocks, not 1.
    assert len(so.scheduled_new_reqs[0].block_ids) == 2
    run_to_completion(sched)


def test_drafts_cut_to_what_the_grammar_accepts():
    from tokenbus.sampling_params import StructuredOutputsParams

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024)
    grammar = FakeGrammars(valid_below=100)
    sched = Scheduler(config, KVCacheManager(50, BLOCK_SIZE, enable_caching=False), grammar)
    request = _decoding(sched, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    _verify(sched, [1, 2], [1, 2, 3], next_drafts=[4, 5, 150, 6])
    assert request.spec_token_ids == [4, 5]
    assert grammar.accepted[-3:] == [1, 2, 3]  # the accepted drafts reached the grammar in order
    sched.finish_requests(["a"], request.status.FINISHED_ABORTED)
    sched.check_integrity()


def test_drafts_past_the_token_budget_or_max_model_len_are_dropped():
    sched = make_scheduler(max_num_batched_tokens=3)
    _decoding(sched, num_prompt=2)
    so, _ = _verify(sched, [1, 2, 3, 4], [1, 2, 9])
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}  # 1 + 2 tokens fill the budget
    sched = make_scheduler(max_model_len=14)
    request = _decoding(sched, max_tokens=None)
    so, _ = _verify(sched, [1, 2, 3, 4], [1, 2])
    # Positions past max_model_len - 2 = 12 are never fed: 10 computed, so 1 + 2 drafts.
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert request.num_computed_tokens == request.num_tokens - 1
    run_to_completion(sched)


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    sched = make_scheduler()
    request = _decoding(sched)
    request.sampling_params.stop_token_ids.append(5)
    _, outputs = _verify(sched, [4, 5, 6], [4, 5, 6, 7], next_drafts=[1])
    assert outputs[0].new_token_ids == [4, 5] and outputs[0].finish_reason is not None
    assert request.spec_token_ids == []
    sched.check_integrity()
