"""The X-ray recorder: exact snapshots of a scripted scheduler (fake runner outputs)."""

import time

import msgspec

from tests.core.sched_utils import fake_runner_output, make_request, make_scheduler
from tokenbus.core.xray import XrayRecorder
from tokenbus.protocol import BlockState, EngineOutputs

F, C, U, S, N = (
    BlockState.FREE,
    BlockState.CACHED,
    BlockState.USED,
    BlockState.SHARED,
    BlockState.NULL,
)


def step(scheduler, recorder, token=7):
    so = scheduler.schedule()
    begun = recorder.begin_step(so)
    runner_output = fake_runner_output(so, scheduler, token)
    outputs = scheduler.update_from_output(so, runner_output)
    recorder.end_step(begun, so, runner_output, len(so.preempted_req_ids))
    return so, outputs


def test_preemption_is_drawn_block_by_block():
    # As test_preemption_evicts_last_admitted_and_resumes: 9 usable blocks, a and b take four
    # each; the next step gives a block 9 and preempts b, whose blocks go back to the head.
    sched = make_scheduler(num_blocks=10)
    recorder = XrayRecorder(sched)
    sched.add_request(make_request("a", 64, max_tokens=40, ignore_eos=True))
    sched.add_request(make_request("b", 64, max_tokens=40, ignore_eos=True))
    step(sched, recorder)

    snap = recorder.snapshot()
    assert list(snap.block_states) == [N, U, U, U, U, U, U, U, U, F]
    assert list(snap.ref_counts) == [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    assert snap.free_order == [9] and snap.num_free_blocks == 1
    rows = {r.request_id: r for r in snap.requests}
    assert rows["a"].block_ids == [1, 2, 3, 4] and rows["b"].block_ids == [5, 6, 7, 8]
    assert (rows["a"].status, rows["a"].num_computed_tokens, rows["a"].num_output_tokens) == (
        "running",
        64,
        1,
    )
    first = snap.steps[-1]
    assert (first.index, first.num_reqs, first.num_prefill_tokens, first.num_decode_tokens) == (
        1,
        2,
        128,
        0,
    )

    sched.add_request(make_request("c", 8, max_tokens=2, ignore_eos=True))
    so, _ = step(sched, recorder)
    assert so.preempted_req_ids == {"b"}
    snap = recorder.snapshot()
    assert list(snap.block_states) == [N, U, U, U, U, F, F, F, F, U]
    # Freed tail first, each prepended: the head of the queue is b's first block.
    assert snap.free_order == [5, 6, 7, 8]
    assert [(r.request_id, r.status, r.block_ids) for r in snap.requests] == [
        ("a", "running", [1, 2, 3, 4, 9]),
        ("b", "preempted", []),
        ("c", "waiting", []),
    ]
    assert snap.requests[1].num_preemptions == 1 and snap.num_requests == 3
    second = snap.steps[-1]
    assert (second.index, second.num_reqs, second.num_decode_tokens, second.num_preemptions) == (
        2,
        1,
        1,
        1,
    )


def test_shared_prefix_blocks_and_cached_free_blocks():
    sched = make_scheduler(num_blocks=12, enable_caching=True)
    recorder = XrayRecorder(sched)
    sched.add_request(make_request("a", 40, max_tokens=1, enable_caching=True, ignore_eos=True))
    step(sched, recorder)  # a: blocks 1-3 (two full, cached), finishes after one token
    sched.add_request(make_request("b", 40, max_tokens=3, enable_caching=True, ignore_eos=True))
    sched.add_request(make_request("c", 40, max_tokens=3, enable_caching=True, ignore_eos=True))
    step(sched, recorder)
    snap = recorder.snapshot()
    rows = {r.request_id: r for r in snap.requests}
    # b and c hit a's two full blocks (freed, still cached) and share them; each gets its own
    # third block (a's partial third block was reused first: unhashed blocks lead the queue).
    assert rows["b"].block_ids[:2] == rows["c"].block_ids[:2] == [1, 2]
    assert rows["b"].num_cached_tokens == rows["c"].num_cached_tokens == 32
    assert snap.block_states[1] == snap.block_states[2] == S
    assert snap.ref_counts[1] == snap.ref_counts[2] == 2
    tails = {rows["b"].block_ids[2], rows["c"].block_ids[2]}
    assert all(snap.block_states[i] == U for i in tails)
    step(sched, recorder)
    step(sched, recorder)  # b and c finish: their blocks go back, full ones still cached
    snap = recorder.snapshot()
    assert snap.requests == [] and snap.num_requests == 0
    assert snap.block_states[1] == snap.block_states[2] == C
    assert snap.num_free_blocks == 11 and len(snap.free_order) == 11
    sched.check_integrity()


def test_snapshots_only_while_watched_and_at_most_once_per_interval():
    sched = make_scheduler()
    recorder = XrayRecorder(sched, interval=0.05)
    sched.add_request(make_request("a", 20, max_tokens=50, ignore_eos=True))
    step(sched, recorder)
    assert recorder.maybe_snapshot() is None  # nobody watches
    assert recorder.watch(10.0).num_requests == 1  # one at once, for an idle page too
    assert recorder.maybe_snapshot() is None  # too soon
    time.sleep(0.06)
    assert recorder.maybe_snapshot() is not None
    recorder.watch(0.0)
    time.sleep(0.06)
    assert recorder.maybe_snapshot() is None  # the viewer left


def test_step_ring_is_bounded_and_snapshot_crosses_processes():
    sched = make_scheduler()
    recorder = XrayRecorder(sched, max_steps=5)
    sched.add_request(make_request("a", 20, max_tokens=50, ignore_eos=True))
    for _ in range(12):
        step(sched, recorder)
    snap = recorder.snapshot()
    assert [s.index for s in snap.steps] == [8, 9, 10, 11, 12]
    wire = msgspec.msgpack.encode(EngineOutputs(xray=snap))
    assert msgspec.msgpack.decode(wire, type=EngineOutputs).xray == snap


def test_step_durations_do_not_count_an_overlap_twice(monkeypatch):
    """Async scheduling launches step 2 before step 1 is read: step 1 lasts from its launch to
    its read, step 2 from step 1's read to its own (not from its launch)."""
    clock = iter([1.0, 2.0, 3.0, 4.5, 5.0, 5.25])
    monkeypatch.setattr("tokenbus.core.xray.time.perf_counter", lambda: next(clock))
    sched = make_scheduler()
    recorder = XrayRecorder(sched)
    sched.add_request(make_request("a", 20, max_tokens=50, ignore_eos=True))
    so1 = sched.schedule()
    begun1 = recorder.begin_step(so1)  # 1.0
    out1 = fake_runner_output(so1, sched, 7)
    so2 = sched.schedule()  # scheduled ahead: its input token is step 1's, unread
    begun2 = recorder.begin_step(so2)  # 2.0
    sched.update_from_output(so1, out1)
    recorder.end_step(begun1, so1, out1, 0)  # 3.0
    out2 = fake_runner_output(so2, sched, 8)
    sched.update_from_output(so2, out2)
    recorder.end_step(begun2, so2, out2, 0)  # 4.5
    so3 = sched.schedule()  # one at a time again: from its launch
    begun3 = recorder.begin_step(so3)  # 5.0
    out3 = fake_runner_output(so3, sched, 9)
    sched.update_from_output(so3, out3)
    recorder.end_step(begun3, so3, out3, 0)  # 5.25
    assert [s.duration_ms for s in recorder.steps] == [2000.0, 1500.0, 250.0]


def test_kv_transfers_in_flight_are_listed():
    from tests.core.test_kv_connector_scheduler import FakeConnector, _step

    # a: its prompt's KV loads asynchronously; p: a prefiller's finished request whose blocks
    # stay held until its KV is sent.
    connector = FakeConnector(external={"a": 40}, load_async=True, send_after_finish={"p"})
    sched = make_scheduler(num_blocks=20, kv_connector=connector)
    recorder = XrayRecorder(sched)
    sched.add_request(make_request("a", 40, max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("p", 20, max_tokens=1, ignore_eos=True, first_token=500))
    _step(sched)
    snap = recorder.snapshot()
    assert (snap.kv_loading, snap.kv_sending) == (["a"], ["p"])
    assert [(r.request_id, r.status, r.block_ids) for r in snap.requests] == [
        ("a", "loading_kv", [1, 2, 3])
    ]
    _step(sched, finished_recving=["a"], finished_sending=["p"])
    snap = recorder.snapshot()
    assert (snap.kv_loading, snap.kv_sending) == ([], [])


def test_big_pools_are_drawn_less_often_and_viewers_share_snapshots():
    from tokenbus.core import xray

    sched = make_scheduler(num_blocks=700, max_model_len=16_384, max_num_batched_tokens=16_384)
    recorder = XrayRecorder(sched, interval=0.25)
    first = recorder.watch(10.0)
    assert recorder.watch(10.0) is first  # a second viewer within the spacing: no new build
    recorder._build_seconds = 0.1  # a snapshot that took 100 ms: 2 % of 5 s
    assert recorder.spacing == 0.1 / xray.MAX_TIME_SHARE
    sched.add_request(make_request("long", 16 * 600, max_tokens=2, ignore_eos=True))
    step(sched, recorder)
    row = recorder.snapshot().requests[0]
    assert row.num_blocks == 600 and len(row.block_ids) == xray.MAX_ROW_BLOCK_IDS
