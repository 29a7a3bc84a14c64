"""The scheduler ↔ worker seam crosses a process boundary as msgpack frames: every field
encodes and decodes to an equal value, with no pickle and no `object` field."""

from __future__ import annotations

import msgspec
import numpy as np

from tests.core.sched_utils import fake_runner_output, make_request, make_scheduler
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.request import RequestStatus
from tokenbus.core.sched.output import GrammarBitmask, SchedulerOutput
from tokenbus.protocol import TokenLogprobs

ENCODER = msgspec.msgpack.Encoder()


def roundtrip(value, cls):
    return msgspec.msgpack.Decoder(cls).decode(ENCODER.encode(value))


def test_a_real_schedule_roundtrips():
    scheduler = make_scheduler()
    for i, n in enumerate((40, 3)):
        scheduler.add_request(make_request(f"r{i}", n, seed=5 + i, temperature=0.7))
    first = scheduler.schedule()
    scheduler.update_from_output(first, fake_runner_output(first, scheduler))
    scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    second = scheduler.schedule()
    for so in (first, second):
        assert roundtrip(so, SchedulerOutput) == so
    assert first.scheduled_new_reqs[0].sampling_params.seed == 5
    assert second.finished_req_ids == {"r1"} and second.scheduled_cached_reqs[0].req_id == "r0"


def test_grammar_bitmask_travels_as_raw_bytes():
    rows = np.arange(-3, 9, dtype=np.int32).reshape(3, 4)
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"a": 1},
        total_num_scheduled_tokens=1,
        structured_output_request_ids={"a": 0},
        grammar_bitmask=GrammarBitmask(rows.tobytes(), *rows.shape),
        kv_connector_metadata=b"\x01\x02",
    )
    back = roundtrip(so, SchedulerOutput)
    assert back == so
    np.testing.assert_array_equal(
        np.frombuffer(back.grammar_bitmask.data, np.int32).reshape(3, 4), rows
    )


def test_runner_output_roundtrips_and_rebuilds_its_index():
    out = ModelRunnerOutput(
        req_ids=["b", "a"],
        sampled_token_ids=[[4, 5], []],
        logprobs=[[TokenLogprobs([4, 9], [-0.1, -2.5], 1)], None],
        spec_token_ids=[[1, 2], []],
    )
    back = roundtrip(out, ModelRunnerOutput)
    assert back == out and back.req_id_to_index == {"b": 0, "a": 1}


def test_empty_defaults_are_not_shared():
    one = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )
    two = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )
    one.finished_req_ids.add("x")
    assert two.finished_req_ids == set() and one.is_empty
