"""Captured decode steps on CPU (a compiled forward) against eager steps, on a tiny model.

Compiling costs seconds, so one captured engine serves most tests (capture sizes 1, 2, 4 and
max_num_seqs 4: a batch of 3 is padded to 4); CUDA graphs have their own tests, skipped
without a GPU (test_cuda_graphs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm
from tests.fixtures.mode_equality import (
    ENGINE,
    NGRAM,
    json_batch,
    ngram_prompts,
    staggered_batch,
    token_ids,
)
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams
from tokenbus.worker.input_batch import ScheduledRequest, prepare_batch
from tokenbus.worker.request_state import CachedRequestState

SIZES = [1, 2, 4]


def runner_of(llm):
    return llm.engine.client.engine_core.executor.worker.runner


@pytest.fixture(scope="module")
def model_dir():
    return cached_tiny_model("llama")


@pytest.fixture(scope="module")
def captured(model_dir):
    llm = make_llm(model_dir, cudagraph_capture_sizes=SIZES, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def eager(model_dir):
    llm = make_llm(model_dir, enforce_eager=True, **ENGINE)
    yield llm
    llm.shutdown()


def count_captured_steps(runner):
    """Wrap the runner's replay to count captured steps by padded size."""
    counts: dict[int, int] = {}
    replay = runner.captured.runner.replay

    def counting(size, batch):
        counts[size] = counts.get(size, 0) + 1
        return replay(size, batch)

    runner.captured.runner.replay = counting
    return counts


def test_eager_engine_captures_nothing(eager):
    assert runner_of(eager).captured is None


def test_greedy_tokens_equal_eager_at_every_batch_size_with_prefill_chunks(captured, eager):
    """Staggered lengths: the decode batch shrinks 4 -> 3 (padded to 4) -> 2 -> 1, and long
    prompts prefill in 64-token chunks next to decodes (mixed steps run eagerly)."""
    requests, params = staggered_batch()
    counts = count_captured_steps(runner_of(captured))
    assert token_ids(captured, requests, params) == token_ids(eager, requests, params)
    assert set(counts) == set(SIZES)  # every size replayed, 3 padded to 4
    assert_engine_clean(captured)


def test_structured_output_equal_eager(captured, eager):
    requests, params = json_batch()
    assert token_ids(captured, requests, params) == token_ids(eager, requests, params)


def test_ngram_spec_decode_equal_eager(model_dir):
    """Steps verifying drafts run eagerly, steps without drafts are captured: same tokens."""
    prompts = ngram_prompts()
    ref_llm = make_llm(model_dir, speculative_config=NGRAM, enforce_eager=True, **ENGINE)
    ref = generate_greedy(ref_llm, prompts, 16)
    ref_llm.shutdown()
    spec = make_llm(model_dir, speculative_config=NGRAM, cudagraph_capture_sizes=SIZES, **ENGINE)
    try:
        counts = count_captured_steps(runner_of(spec))
        with spec.engine.measure_spec_decode() as metrics:
            assert generate_greedy(spec, prompts, 16) == ref
        assert counts and metrics.num_drafts > 0  # captured steps and verified drafts both ran
    finally:
        spec.shutdown()


def test_padded_step_changes_no_real_kv_outside_its_own_slots(captured):
    """Three decodes padded to 4: every KV byte outside their three slots and the null block
    (block 0) is unchanged."""
    runner = runner_of(captured)
    block_size = runner.block_size
    states = [
        CachedRequestState(
            f"r{i}",
            prompt_token_ids=[7 + i] * (5 + 9 * i),
            output_token_ids=[],
            sampling_params=SamplingParams(max_tokens=1),
            block_ids=[3 + 4 * i, 4 + 4 * i],
            num_computed_tokens=4 + 9 * i,
        )
        for i in range(3)
    ]
    original = [
        cache.clone() for cache in runner.kv_caches
    ]  # the engine's prefix cache: restored below
    for cache in runner.kv_caches:
        cache.normal_()  # no slot is left at zero: a stray write shows
    before = [cache.clone() for cache in runner.kv_caches]
    requests = [ScheduledRequest(state, 1, []) for state in states]
    assert runner.captured.padded_size(requests) == 4
    try:
        with torch.inference_mode():
            batch = prepare_batch(
                requests, runner.buffers, block_size, runner.kv_caches, padded_size=4
            )
            hidden = runner.captured.run(batch)
        assert hidden.shape[0] == 4 and torch.isfinite(hidden).all()
        own = {
            s.block_ids[s.num_computed_tokens // block_size] * block_size
            + s.num_computed_tokens % block_size
            for s in states
        }
        for cache, old in zip(runner.kv_caches, before):
            changed = (
                (cache != old).flatten(3).any(-1).any(0).flatten()
            )  # [2, NB, bs, Hkv * D] -> [NB * bs] slots
            changed_slots = set(changed.nonzero().flatten().tolist())
            assert changed_slots - set(range(block_size)) == own  # block 0 (the null block) aside
    finally:
        for cache, old in zip(runner.kv_caches, original):
            cache.copy_(old)


def test_dispatcher_pads_uniform_decodes_only(captured):
    runner = runner_of(captured)
    state = CachedRequestState("x", [1, 2, 3], [], SamplingParams(), [1], 2)
    decode, chunk = ScheduledRequest(state, 1, []), ScheduledRequest(state, 2, [])
    verify = ScheduledRequest(state, 1, [5])
    assert [runner.captured.padded_size([decode] * n) for n in (1, 2, 3, 4, 5)] == [
        1,
        2,
        4,
        4,
        None,
    ]
    assert runner.captured.padded_size([decode, chunk]) is None
    assert runner.captured.padded_size([verify]) is None
    assert runner.captured.padded_size([]) is None


def test_compile_failure_falls_back_with_one_warning_or_fails_when_sizes_were_asked(
    model_dir, monkeypatch, caplog
):
    import logging

    from tokenbus.worker import captured_step, compiled_cpu

    def broken(self, size, batch):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(compiled_cpu.CompiledCpuRunner, "capture", broken)
    monkeypatch.setattr(captured_step, "CPU_CAPTURES_BY_DEFAULT", True)  # default sizes compile too
    with caplog.at_level(logging.WARNING, logger="tokenbus.worker.captured_step"):
        llm = make_llm(model_dir, **ENGINE)
    try:
        assert runner_of(llm).captured is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "no compiler today" in warnings[0].getMessage()
        assert generate_greedy(llm, [[5, 6, 7]], 3)  # eager steps work
    finally:
        llm.shutdown()
    with pytest.raises(
        RuntimeError, match=r"cudagraph-capture-sizes \[1, 2\]: RuntimeError: no compiler today"
    ):
        make_llm(model_dir, cudagraph_capture_sizes=[1, 2], **ENGINE)


WARM_START = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from tests.e2e.utils import make_llm
    from tokenbus.worker.compiled_cpu import compile_counters
    llm = make_llm({model!r}, cudagraph_capture_sizes=[1], max_num_seqs=1, max_model_len=64)
    print("COUNTERS", json.dumps(compile_counters()))
    llm.shutdown()
""")


def test_compile_cache_is_reused_on_the_second_start(model_dir, tmp_path):
    """Two fresh processes on one empty cache dir: the first compiles, the second only loads."""
    env = dict(os.environ, TOKENBUS_CACHE_DIR=str(tmp_path))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = WARM_START.format(root=root, model=str(model_dir))
    counters = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("COUNTERS"))
        counters.append(json.loads(line.split(" ", 1)[1]))
    assert counters[0]["fxgraph_cache_miss"] >= 1 and counters[0]["fxgraph_cache_hit"] == 0
    assert counters[1]["fxgraph_cache_miss"] == 0 and counters[1]["fxgraph_cache_hit"] >= 1
    assert any((tmp_path / "inductor").iterdir())  # under tokenbus' cache dir
