"""--cudagraph-capture-sizes / --enforce-eager, and batches padded to a capture size."""

from __future__ import annotations

import pytest
import torch

from tokenbus.engine_args import EngineArgs
from tokenbus.sampling_params import SamplingParams
from tokenbus.worker.input_batch import InputBuffers, ScheduledRequest, StepShape, prepare_batch
from tokenbus.worker.request_state import CachedRequestState


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cudagraph_capture_sizes=[0, 2]), "sizes must be >= 1, got 0"),
        (dict(cudagraph_capture_sizes=[2, 2, 4]), "must be strictly increasing"),
        (dict(cudagraph_capture_sizes=[4, 2]), "must be strictly increasing"),
        (dict(cudagraph_capture_sizes=[1, 4096]), "size 4096 is above max_num_batched_tokens"),
        (
            dict(cudagraph_capture_sizes=[1, 2], enforce_eager=True),
            "cannot be combined with enforce_eager",
        ),
        (dict(cudagraph_capture_sizes="1,x"), "must be integers"),
        (dict(cudagraph_capture_sizes=[]), "at least one size"),
    ],
)
def test_bad_capture_flags_are_value_errors_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match="--cudagraph-capture-sizes") as info:
        EngineArgs(**kwargs).to_config(256)
    assert message in str(info.value)


def test_default_capture_sizes_follow_max_num_seqs():
    sizes = EngineArgs(max_num_seqs=40).to_config(256).compilation.cudagraph_capture_sizes
    assert sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert EngineArgs(max_num_seqs=20).to_config(256).compilation.cudagraph_capture_sizes == (
        1,
        2,
        4,
        8,
        16,
        20,
    )
    assert EngineArgs(enforce_eager=True).to_config(256).compilation.cudagraph_capture_sizes == ()
    assert EngineArgs(cudagraph_capture_sizes="1 2,8").to_config(
        256
    ).compilation.cudagraph_capture_sizes == (1, 2, 8)


def test_cli_flags(tmp_path):
    import argparse

    from tokenbus.cli.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--cudagraph-capture-sizes", "1", "2", "8"]))
    assert args.to_config(256).compilation.cudagraph_capture_sizes == (1, 2, 8)
    assert (
        engine_args_from(parser.parse_args(["--enforce-eager"]))
        .to_config(256)
        .compilation.enforce_eager
    )


def test_padding_rows_use_the_null_block_and_are_never_sampled():
    buffers = InputBuffers(
        max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=5, device=torch.device("cpu")
    )
    buffers.block_table[:] = 9  # stale ids from an earlier step
    states = [
        CachedRequestState(f"r{i}", [3] * (6 + i), [], SamplingParams(), [2 + i, 5 + i], 5 + i)
        for i in range(3)
    ]
    kv = [torch.zeros(2, 12, 4, 1, 2)]
    batch = prepare_batch(
        [ScheduledRequest(s, 1, []) for s in states], buffers, 4, kv, StepShape(8)
    )
    ctx = batch.ctx
    assert (batch.num_tokens, batch.padded, ctx.num_tokens, ctx.num_reqs) == (
        3,
        StepShape(8),
        8,
        8,
    )
    # padding: slot 0
    assert ctx.slot_mapping.tolist() == [5 * 4 + 1, 6 * 4 + 2, 7 * 4 + 3] + [0] * 5
    assert ctx.positions.tolist()[3:] == [0] * 5 and batch.input_ids.tolist()[3:] == [0] * 5
    assert ctx.seq_lens == [6, 7, 8] + [1] * 5 and ctx.seq_lens_t.tolist() == ctx.seq_lens
    assert ctx.query_start_loc == list(range(9)) and ctx.query_start_loc_t.tolist() == list(
        range(9)
    )
    assert ctx.block_tables.shape == (8, 5)  # full width: the shape depends on the padded size only
    assert (ctx.block_tables[3:] == 0).all() and ctx.block_tables[0, :2].tolist() == [2, 5]
    assert batch.logits_indices.tolist() == [0, 1, 2] and batch.sampling_requests == [0, 1, 2]
    assert ctx.num_decodes == 8
    # The buffers are persistent: the step's tensors are views of them, rewritten in place.
    assert ctx.positions.data_ptr() == buffers.staged["positions"].device.data_ptr()
    with pytest.raises(ValueError, match="a request of 2 query tokens cannot be padded"):
        prepare_batch([ScheduledRequest(states[0], 2, [])], buffers, 4, kv, StepShape(4))


def test_every_kv_groups_padding_rows_use_the_null_block():
    """A hybrid KV cache: each group's slots and tables are padded in its own buffers, at the
    full table width, as group 0's are."""
    from tokenbus.core.kv.hybrid import plan_kv_groups

    groups = plan_kv_groups([None, 8])  # group 1: the windowed layer
    buffers = InputBuffers(16, 8, 5, torch.device("cpu"), kv_groups=groups)
    for name in ("block_table", "block_table_1"):
        buffers.staged[name].np[:] = 9  # stale ids from an earlier step
    states = [
        CachedRequestState(f"r{i}", [3] * (6 + i), [], SamplingParams(), [2 + i, 5 + i], 5 + i)
        for i in range(2)
    ]
    for i, state in enumerate(states):
        state.group_block_ids = [[0, 7 + i]]  # its first block handed back: the null block
    kv = [torch.zeros(2, 12, 4, 1, 2)] * 2
    requests = [ScheduledRequest(s, 1, []) for s in states]
    ctx = prepare_batch(requests, buffers, 4, kv, StepShape(4)).ctx
    (group,) = ctx.kv_groups
    assert group.slot_mapping.tolist() == [7 * 4 + 1, 8 * 4 + 2, 0, 0]
    assert ctx.slot_mapping.tolist() == [5 * 4 + 1, 6 * 4 + 2, 0, 0]
    for tables in (ctx.block_tables, group.block_tables):
        assert tables.shape == (4, 5) and (tables[2:] == 0).all()
    assert group.block_tables[:2, :2].tolist() == [[0, 7], [0, 8]]
    assert ctx.layer_groups == (0, 1)


def test_verification_steps_pad_whole_requests_of_one_plus_k_tokens():
    """Two requests verifying 2 drafts each, padded to 4 requests of 3 tokens: padding tokens
    at positions 0, 1, 2 of the null block (slot 0), seq_len 3; logits at the real 1 + k rows."""
    buffers = InputBuffers(16, 8, 5, torch.device("cpu"))
    states = [
        CachedRequestState(f"r{i}", [3] * (6 + i), [], SamplingParams(), [2, 5, 8 + i], 5 + i)
        for i in range(2)
    ]
    requests = [ScheduledRequest(s, 3, [40 + i, 50 + i]) for i, s in enumerate(states)]
    kv = [torch.zeros(2, 12, 4, 1, 2)]
    batch = prepare_batch(requests, buffers, 4, kv, StepShape(4, 3))
    ctx = batch.ctx
    assert (batch.num_tokens, ctx.num_tokens, ctx.num_reqs, ctx.num_decodes) == (6, 12, 4, 0)
    assert ctx.query_start_loc == [0, 3, 6, 9, 12] and ctx.seq_lens == [8, 9, 3, 3]
    assert ctx.positions.tolist() == [5, 6, 7, 6, 7, 8] + [0, 1, 2] * 2
    assert batch.input_ids.tolist()[:6] == [3, 40, 50, 3, 41, 51]
    assert batch.input_ids.tolist()[6:] == [0] * 6
    assert (
        ctx.slot_mapping.tolist()[:6] == [21, 22, 23, 22, 23, 36]
        and ctx.slot_mapping.tolist()[6:] == [0] * 6
    )
    assert ctx.block_tables.shape == (4, 5) and (ctx.block_tables[2:] == 0).all()
    assert batch.logits_indices.tolist() == list(range(6))
    assert batch.num_logits_per_request == [3, 3]
    with pytest.raises(ValueError, match="a request of 3 query tokens cannot be padded"):
        prepare_batch(requests, buffers, 4, kv, StepShape(2, 2))


def test_a_request_short_of_drafts_gets_dummy_rows_after_its_own():
    """k = 2: a plain decode and a request with one draft, in a step of 2 requests of 3 rows.
    Each request's own tokens come first at their positions and slots; its dummy rows (token
    0, position 0, slot 0) follow and count in its seq_len, so its own tokens keep their
    causal ends; logits only at its own rows."""
    buffers = InputBuffers(16, 8, 5, torch.device("cpu"))
    states = [
        CachedRequestState(f"r{i}", [3] * (6 + i), [], SamplingParams(), [2, 5, 8 + i], 5 + i)
        for i in range(2)
    ]
    requests = [ScheduledRequest(states[0], 1, []), ScheduledRequest(states[1], 2, [41])]
    kv = [torch.zeros(2, 12, 4, 1, 2)]
    batch = prepare_batch(requests, buffers, 4, kv, StepShape(2, 3))
    ctx = batch.ctx
    assert (batch.num_tokens, ctx.num_tokens, ctx.num_reqs, ctx.num_decodes) == (6, 6, 2, 0)
    assert ctx.query_start_loc == [0, 3, 6] and ctx.seq_lens == [5 + 3, 6 + 3]
    assert ctx.positions.tolist() == [5, 0, 0, 6, 7, 0]
    assert batch.input_ids.tolist() == [3, 0, 0, 3, 41, 0]
    assert ctx.slot_mapping.tolist() == [21, 0, 0, 22, 23, 0]
    assert batch.logits_indices.tolist() == [0, 3, 4]
    assert batch.num_logits_per_request == [1, 2]


def test_dispatcher_pads_uniform_decodes_only():
    from tokenbus.worker.captured_step import CaptureDispatcher

    dispatcher = CaptureDispatcher((1, 2, 4))
    state = CachedRequestState("x", [1, 2, 3], [], SamplingParams(), [1], 2)
    decode, chunk = ScheduledRequest(state, 1, []), ScheduledRequest(state, 2, [])
    verify = ScheduledRequest(state, 1, [5])
    assert [dispatcher.shape([decode] * n) for n in (1, 2, 3, 4, 5)] == [
        StepShape(1),
        StepShape(2),
        StepShape(4),
        StepShape(4),
        None,
    ]
    assert dispatcher.shape([decode, chunk]) is None
    assert dispatcher.shape([verify]) is None
    assert dispatcher.shape([]) is None


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_request_pools_its_own_rows_not_its_dummy_rows(pooling):
    """A one-token embedding chunk beside a verification gets dummy rows; its vector comes
    from its own row alone."""
    from tokenbus.worker.pooling import compute_pooled

    buffers = InputBuffers(16, 8, 5, torch.device("cpu"))
    embed = CachedRequestState("e", [7], [], SamplingParams(pooling=pooling), [2], 0)
    verify = CachedRequestState("v", [3] * 6, [], SamplingParams(), [4, 5], 5)
    requests = [ScheduledRequest(embed, 1, [], pools=True), ScheduledRequest(verify, 3, [8, 9])]
    kv = [torch.zeros(2, 12, 4, 1, 2)]
    batch = prepare_batch(requests, buffers, 4, kv, StepShape(2, 3))
    assert batch.ctx.query_start_loc == [0, 3, 6]
    hidden = torch.eye(6)  # row r: the unit vector e_r
    pooled = compute_pooled(hidden, batch)
    assert pooled[0] == torch.eye(6)[0].tolist() and pooled[1] is None


def test_dispatcher_pads_verification_steps():
    """With k = 2 drafts: verification steps are padded to 3 rows a request, up to the sizes
    whose tokens fit the buffers (4 * 3 > 10), requests short of drafts (plain decodes too)
    with dummy rows; a step with a prefill chunk runs eagerly."""
    from tokenbus.worker.captured_step import CaptureDispatcher

    dispatcher = CaptureDispatcher((1, 2, 4), query_lens=(1, 3), max_num_tokens=10)
    state = CachedRequestState("x", [1, 2, 3], [], SamplingParams(), [1], 2)
    verify, short = ScheduledRequest(state, 3, [5, 6]), ScheduledRequest(state, 2, [5])
    chunk, decode = ScheduledRequest(state, 3, []), ScheduledRequest(state, 1, [])
    assert set(dispatcher.shapes) == {
        *(StepShape(n) for n in (1, 2, 4)),
        *(StepShape(n, 3) for n in (1, 2)),
    }
    # What the graph-memory profile captures: the largest at each query length.
    assert dispatcher.largest() == (StepShape(4), StepShape(2, 3))
    assert [dispatcher.shape([verify] * n) for n in (1, 2, 3)] == [
        StepShape(1, 3),
        StepShape(2, 3),
        None,
    ]
    assert dispatcher.shape([decode] * 3) == StepShape(4)
    for mixed in ([verify, short], [short], [verify, decode], [decode, short]):
        assert dispatcher.shape(mixed) == StepShape(len(mixed), 3)
    for mixed in ([chunk], [verify, chunk], [decode, chunk]):
        assert dispatcher.shape(mixed) is None


def test_dummy_rows_stay_within_a_memory_bound_step(monkeypatch):
    """Dummy draft rows are captured only while the padded step has at most
    MAX_DUMMY_PADDED_TOKENS tokens; a step whose every request has all k drafts, at any size."""
    from tokenbus.worker import captured_step

    monkeypatch.setattr(captured_step, "MAX_DUMMY_PADDED_TOKENS", 6)
    dispatcher = captured_step.CaptureDispatcher((1, 2, 4), query_lens=(1, 3))
    state = CachedRequestState("x", [1, 2, 3], [], SamplingParams(), [1], 2)
    verify, short = ScheduledRequest(state, 3, [5, 6]), ScheduledRequest(state, 2, [5])
    assert dispatcher.shape([verify, short]) == StepShape(2, 3)  # 6 tokens
    assert dispatcher.shape([verify, short, short]) is None  # 12
    assert dispatcher.shape([verify] * 3) == StepShape(4, 3)
