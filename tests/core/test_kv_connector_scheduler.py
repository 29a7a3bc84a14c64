"""The scheduler with a fake KV connector's scheduler half: external tokens (synchronous and
asynchronous), delayed frees, aborts mid-transfer, failed loads. Exact block ids, leak check."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.core.sched_utils import BLOCK_SIZE, fake_runner_output, make_request, make_scheduler
from tokenbus.core.outputs import KVConnectorOutput, ModelRunnerOutput
from tokenbus.core.request import RequestStatus
from tokenbus.protocol import FinishReason


@dataclass
class FakeConnector:
    """Offers `external[req_id]` tokens (asynchronously if `load_async`), and keeps the blocks
    of finished requests listed in `send_after_finish`."""

    external: dict[str, int] = field(default_factory=dict)
    load_async: bool = False
    send_after_finish: set[str] = field(default_factory=set)
    allocs: list[tuple[str, list[int], int]] = field(default_factory=list)
    finished: list[tuple[str, list[int]]] = field(default_factory=list)
    metas: int = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external.get(request.request_id, 0), self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.metas += 1
        return b"meta"

    def update_connector_output(self, output):
        pass

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        if request.request_id in self.send_after_finish:
            return True, {"remote_block_ids": list(block_ids)}
        return False, None

    def tier_occupancy(self):
        return {}


def _with_kv(output: ModelRunnerOutput, **fields) -> ModelRunnerOutput:
    output.kv_connector_output = KVConnectorOutput(**fields)
    return output


def _step(sched, **kv_fields):
    so = sched.schedule()
    out = fake_runner_output(so, sched)
    if kv_fields:
        out = _with_kv(out, **kv_fields)
    return so, sched.update_from_output(so, out)


def test_synchronous_external_tokens_count_as_computed_in_the_same_step():
    connector = FakeConnector(external={"a": 32})
    sched = make_scheduler(num_blocks=10, kv_connector=connector)
    sched.add_request(make_request("a", 40, max_tokens=2, ignore_eos=True))
    so, outputs = _step(sched)
    assert so.num_scheduled_tokens == {"a": 8}  # 40 - 32 loaded
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert so.kv_connector_metadata == b"meta"
    assert connector.allocs == [("a", [1, 2, 3], 32)]
    assert outputs[0].new_token_ids == [7] and outputs[0].num_cached_tokens == 32
    stats = sched.make_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (40, 32)
    _step(sched)
    assert connector.finished == [("a", [1, 2, 3])]
    sched.check_integrity()


def test_asynchronous_load_waits_without_holding_others_then_computes_only_the_last_token():
    connector = FakeConnector(external={"a": 40}, load_async=True)
    sched = make_scheduler(num_blocks=10, kv_connector=connector)
    sched.add_request(make_request("a", 40, max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("b", 8, max_tokens=1, ignore_eos=True, first_token=500))
    so, _ = _step(sched)
    a = sched.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.num_scheduled_tokens == {"b": 8}  # b is not held up by a's load
    assert sched.kv.get_block_ids("a") == [1, 2, 3]
    # not cached yet
    assert all(sched.kv.block_pool.blocks[i].block_hash is None for i in (1, 2, 3))
    # b finished; a's load is still in flight: nothing is scheduled, nothing freed.
    so, _ = _step(sched)
    assert so.num_scheduled_tokens == {} and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _step(sched, finished_recving=["a"])
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 39
    so, outputs = _step(sched)
    assert so.num_scheduled_tokens == {"a": 1}  # only the last prompt token, for its logits
    assert so.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    assert outputs[0].num_cached_tokens == 39
    while sched.has_unfinished_requests():
        _step(sched)
    sched.check_integrity()


def test_producer_keeps_blocks_until_the_worker_reports_them_sent():
    connector = FakeConnector(send_after_finish={"a"})
    sched = make_scheduler(num_blocks=10, kv_connector=connector)
    sched.add_request(make_request("a", 20, max_tokens=1, ignore_eos=True))
    _, outputs = _step(sched)
    assert outputs[0].finish_reason == FinishReason.LENGTH
    assert outputs[0].kv_transfer_params == {"remote_block_ids": [1, 2]}
    assert sched.has_unfinished_requests()  # the loop must keep polling the worker
    assert sched.kv.num_free_blocks == 10 - 1 - 2
    with pytest.raises(AssertionError, match="held for KV transfer"):
        sched.check_integrity()
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(make_request("a", 4))  # its id still names held blocks
    _step(sched, finished_sending=["a"])
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def test_abort_during_an_asynchronous_load_frees_only_when_the_load_ends():
    connector = FakeConnector(external={"a": 32}, load_async=True)
    sched = make_scheduler(num_blocks=10, kv_connector=connector)
    sched.add_request(make_request("a", 40))
    _step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.holds_blocks("a")  # the worker may still write into them
    _step(sched)
    assert sched.kv.holds_blocks("a")
    _step(sched, finished_recving=["a"])
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_synchronous_load_recomputes_or_fails_and_evicts_the_bad_block(policy):
    connector = FakeConnector(external={"a": 32})
    sched = make_scheduler(
        num_blocks=10, kv_connector=connector, enable_caching=True, kv_load_failure_policy=policy
    )
    sched.add_request(make_request("a", 40, max_tokens=2, ignore_eos=True, enable_caching=True))
    so, outputs = _step(sched, invalid_block_ids=[2])  # the second loaded block was bad
    assert all(block.block_hash is None for block in [sched.kv.block_pool.blocks[2]])
    if policy == "fail":
        assert [o.finish_reason for o in outputs] == [FinishReason.ERROR]
        assert not sched.has_unfinished_requests()
        sched.check_integrity()
        return
    assert outputs == []  # the step's sample for it is void
    a = sched.requests["a"]
    assert a.status == RequestStatus.PREEMPTED and a.kv_load_failed
    so, outputs = _step(sched)
    assert so.preempted_req_ids == {"a"}
    # Block 1 (loaded fine, cached) is a prefix hit; the rest is computed, not asked of the
    # connector.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"a": 24}
    assert outputs[0].new_token_ids == [7]
    assert outputs[0].num_cached_tokens == 16  # what it found, not the 32 first offered
    while sched.has_unfinished_requests():
        _step(sched)
    sched.check_integrity()


def test_partly_failed_asynchronous_load_keeps_the_good_prefix():
    connector = FakeConnector(external={"a": 48}, load_async=True)
    sched = make_scheduler(num_blocks=10, kv_connector=connector, enable_caching=True)
    sched.add_request(make_request("a", 48, max_tokens=1, ignore_eos=True, enable_caching=True))
    _step(sched)
    assert sched.kv.get_block_ids("a") == [1, 2, 3]
    _step(sched, finished_recving=["a"], invalid_block_ids=[2])
    a = sched.requests["a"]
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == BLOCK_SIZE
    so, _ = _step(sched)
    assert so.num_scheduled_tokens == {"a": 32}
    assert so.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    while sched.has_unfinished_requests():
        _step(sched)
    sched.check_integrity()


def test_connector_is_not_asked_for_requests_that_need_every_position():
    connector = FakeConnector(external={"a": 32})
    sched = make_scheduler(num_blocks=10, kv_connector=connector)
    sched.add_request(make_request("a", 40, max_tokens=1, prompt_logprobs=1))
    so, _ = _step(sched)
    assert so.num_scheduled_tokens == {"a": 40}
    _step(sched)
    sched.check_integrity()


def test_failed_synchronous_load_uncaches_the_blocks_computed_over_it():
    """Blocks computed in the step whose load failed read the bad block: their K/V is wrong too,
    so no later request may hit them (even once the bad block's hash is cached again)."""
    connector = FakeConnector(external={"a": 32})
    sched = make_scheduler(num_blocks=10, kv_connector=connector, enable_caching=True)
    sched.add_request(make_request("a", 56, max_tokens=1, ignore_eos=True, enable_caching=True))
    so, _ = _step(sched, invalid_block_ids=[2])  # blocks 1, 2 loaded (2 failed), 3 computed over 2
    assert so.num_scheduled_tokens == {"a": 24}
    assert [sched.kv.block_pool.blocks[i].block_hash is None for i in (1, 2, 3)] == [
        False,
        True,
        True,
    ]
    so, _ = _step(sched)  # a recomputes from its second block: those hashes are cached anew
    recomputed_table = so.scheduled_new_reqs[0].block_ids
    while sched.has_unfinished_requests():
        _step(sched)
    connector.external = {}
    sched.add_request(make_request("b", 56, max_tokens=1, ignore_eos=True, enable_caching=True))
    so, _ = _step(sched)
    # b hits what a recomputed, never the block computed over the failed load.
    assert so.scheduled_new_reqs[0].block_ids[:3] == recomputed_table[:3]
    while sched.has_unfinished_requests():
        _step(sched)
    sched.check_integrity()


def test_external_lookups_are_counted_once_per_request_not_per_retry():
    connector = FakeConnector(external={"b": 16})
    sched = make_scheduler(num_blocks=6, kv_connector=connector)  # 5 usable blocks
    # takes 4 (+1 to decode)
    sched.add_request(make_request("a", 64, max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("b", 40, max_tokens=1, ignore_eos=True, first_token=500))
    queries = hits = 0
    while sched.has_unfinished_requests():
        _step(sched)
        stats = sched.make_stats()
        queries += stats.external_prefix_cache_queries
        hits += stats.external_prefix_cache_hits
    assert (queries, hits) == (40 + 64, 16)  # b waited for room at least once
    sched.check_integrity()


def test_fail_policy_keeps_blocks_of_a_load_still_in_flight_until_it_ends():
    connector = FakeConnector(external={"a": 48}, load_async=True)
    sched = make_scheduler(num_blocks=10, kv_connector=connector, kv_load_failure_policy="fail")
    sched.add_request(make_request("a", 48, max_tokens=1, ignore_eos=True))
    _step(sched)
    # The connector reports a bad block before the load's end: the request fails at once...
    _, outputs = _step(sched, invalid_block_ids=[2])
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR]
    # ...but its blocks stay held while the worker may still write them.
    assert sched.kv.holds_blocks("a") and sched.has_unfinished_requests()
    _step(sched, finished_recving=["a"])
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def _run_counting_external(sched, reports: dict[int, dict]) -> list[tuple[int, int]]:
    """Step until done, the worker's KV report of step i being reports.get(i); the external
    (queries, hits) of each step's stats."""
    counts = []
    step = 0
    while sched.has_unfinished_requests():
        _step(sched, **reports.get(step, {}))
        stats = sched.make_stats()
        counts.append((stats.external_prefix_cache_queries, stats.external_prefix_cache_hits))
        step += 1
    sched.check_integrity()  # every offered hit was settled, counted or not
    return counts


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_external_hit_counts_only_once_a_synchronous_load_succeeded(policy):
    def run(reports):
        sched = make_scheduler(
            num_blocks=10,
            kv_connector=FakeConnector(external={"a": 32}),
            enable_caching=True,
            kv_load_failure_policy=policy,
        )
        sched.add_request(make_request("a", 40, max_tokens=2, ignore_eos=True, enable_caching=True))
        return _run_counting_external(sched, reports)

    failed = run({0: {"invalid_block_ids": [2]}})
    assert failed[0] == (40, 0)  # looked up; the load failed: no hit
    assert sum(hits for _, hits in failed) == 0  # nor later: it computes, never asks again
    loaded = run({})
    assert loaded[0] == (40, 32) and sum(hits for _, hits in loaded) == 32


def test_external_hit_of_an_asynchronous_load_counts_what_came_in_when_it_did():
    def run(load_report: dict, policy: str = "recompute"):
        sched = make_scheduler(
            num_blocks=10,
            kv_connector=FakeConnector(external={"a": 48}, load_async=True),
            enable_caching=True,
            kv_load_failure_policy=policy,
        )
        sched.add_request(make_request("a", 48, max_tokens=1, ignore_eos=True, enable_caching=True))
        return _run_counting_external(sched, {1: load_report})

    loaded = run({"finished_recving": ["a"]})
    assert loaded[:2] == [(48, 0), (0, 48)]  # asked at admission, a hit once the load ended
    assert sum(hits for _, hits in loaded) == 48
    # The second block failed: only the first came in (and counts); the rest is computed.
    partial = run({"finished_recving": ["a"], "invalid_block_ids": [2]})
    assert partial[:2] == [(48, 0), (0, BLOCK_SIZE)]
    assert sum(hits for _, hits in partial) == BLOCK_SIZE
    failed = run({"finished_recving": ["a"], "invalid_block_ids": [2]}, policy="fail")
    assert sum(hits for _, hits in failed) == 0


def test_external_hit_of_a_load_aborted_midway_is_not_counted():
    connector = FakeConnector(external={"a": 32}, load_async=True)
    sched = make_scheduler(num_blocks=10, kv_connector=connector)
    sched.add_request(make_request("a", 40))
    _step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    _step(sched, finished_recving=["a"])
    assert sched.make_stats().external_prefix_cache_hits == 0
    sched.check_integrity()
