"""--scheduling-policy priority with fake runner outputs: waiting order, the preemption victim,
and the leak check; fcfs beside it for contrast."""

from __future__ import annotations

import pytest

from tests.core.sched_utils import make_request, run_step, run_to_completion
from tokenbus.config import SchedulerConfig
from tokenbus.core.kv import KVCacheManager
from tokenbus.core.request import RequestStatus
from tokenbus.core.sched.scheduler import Scheduler

BLOCK_SIZE = 16


def make_scheduler(policy: str, num_blocks: int = 100, max_num_seqs: int = 16) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=1024,
        scheduling_policy=policy,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=False))


def request(request_id: str, num_tokens: int, priority: int, arrival: float, **params):
    req = make_request(request_id, num_tokens, first_token=100 + 1000 * arrival, **params)
    req.priority, req.arrival_time = priority, arrival
    return req


def test_waiting_queue_is_ordered_by_priority_then_arrival():
    sched = make_scheduler("priority", max_num_seqs=1)
    for req_id, priority, arrival in (("c", 2, 1.0), ("a", 0, 3.0), ("b", 2, 0.5), ("d", 0, 4.0)):
        sched.add_request(request(req_id, 8, priority, arrival, max_tokens=2, ignore_eos=True))
    assert [r.request_id for r in sched.waiting] == ["a", "d", "b", "c"]
    so, _ = run_step(sched)  # one seat: the highest priority, earliest arrival
    assert list(so.num_scheduled_tokens) == ["a"]
    fcfs = make_scheduler("fcfs", max_num_seqs=1)
    for req_id, priority, arrival in (("c", 2, 1.0), ("a", 0, 3.0)):
        fcfs.add_request(request(req_id, 8, priority, arrival, max_tokens=2, ignore_eos=True))
    assert [r.request_id for r in fcfs.waiting] == ["c", "a"]  # arrival order only


@pytest.mark.parametrize("policy, victim", [("fcfs", "hi"), ("priority", "lo")])
def test_memory_pressure_preempts_the_lowest_priority_first(policy, victim):
    # 9 usable blocks. lo (priority 5) arrives first, hi (priority 0) second; both 64-token
    # prompts take 4 blocks. The next step each needs a fifth: one block is free, so one of
    # them is preempted: fcfs the last admitted (hi), priority the lowest priority (lo).
    sched = make_scheduler(policy, num_blocks=10)
    sched.add_request(request("lo", 64, 5, 1.0, max_tokens=40, ignore_eos=True))
    sched.add_request(request("hi", 64, 0, 2.0, max_tokens=40, ignore_eos=True))
    so, _ = run_step(sched)
    assert set(so.num_scheduled_tokens) == {"lo", "hi"}
    so, _ = run_step(sched)
    assert so.preempted_req_ids == {victim}
    survivor = "lo" if victim == "hi" else "hi"
    assert so.num_scheduled_tokens == {survivor: 1}
    assert sched.requests[victim].status == RequestStatus.PREEMPTED
    # The survivor was admitted first either way (fcfs: by arrival; priority: by priority).
    assert sched.kv.get_block_ids(survivor) == [1, 2, 3, 4, 9]
    tokens = run_to_completion(sched)
    # Counted after the two steps above: the survivor had 2 tokens, the victim 1 (kept).
    assert len(tokens[survivor]) == 38 and len(tokens[victim]) == 39


def test_a_preempted_request_waits_behind_higher_priorities_and_before_later_equals():
    sched = make_scheduler("priority", num_blocks=10)
    sched.add_request(request("hi", 64, 0, 2.0, max_tokens=40, ignore_eos=True))
    sched.add_request(request("lo", 64, 5, 1.0, max_tokens=40, ignore_eos=True))
    run_step(sched)
    sched.add_request(request("urgent", 8, 0, 3.0, max_tokens=2, ignore_eos=True))
    sched.add_request(request("later", 8, 5, 4.0, max_tokens=2, ignore_eos=True))
    so, _ = run_step(sched)
    assert so.preempted_req_ids == {"lo"}
    assert [r.request_id for r in sched.waiting] == ["urgent", "lo", "later"]
    run_to_completion(sched)
