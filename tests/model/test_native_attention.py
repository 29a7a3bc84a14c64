"""The native CPU paged-attention kernel against the torch path on the same cache and batch."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil

import pytest
import torch
from tests.fixtures.native_sources import copied_source

from tokenbus.model import ForwardContext, attention
from tokenbus.model.attention import build_attention_plan, paged_attention
from tokenbus.model.attention_backend import select_attention_kernel
from tokenbus.model.native import NativeBuildError, build_shared_object, load_paged_attention

BLOCK_SIZE = 16
# Without a compiler tokenbus falls back to the torch path (tested below); with one, the kernel
# must build, so only a missing compiler skips.
needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the native kernel cannot be built here",
)


@pytest.fixture(scope="module")
def kernel():
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    return load_paged_attention()


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
    block_size: int = BLOCK_SIZE,
):
    """requests: (q_len, context_len) each; decodes (q_len 1) must come first. A random cache with
    shuffled blocks, this step's q/k/v, and the ForwardContext."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(q + c) // block_size) for q, c in requests]
    num_blocks = sum(blocks_per_req) + 3
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(blocks_per_req)
    # wider than needed, like the runner's
    tables = torch.zeros(len(requests), width + 2, dtype=torch.int64)
    slots, positions, starts, seq_lens = [], [], [0], []
    for r, ((q_len, ctx_len), n) in enumerate(zip(requests, blocks_per_req)):
        ids = [perm.pop() for _ in range(n)]
        tables[r, :n] = torch.tensor(ids)
        for pos in range(ctx_len, ctx_len + q_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
        starts.append(starts[-1] + q_len)
        seq_lens.append(ctx_len + q_len)
    num_decodes = sum(1 for q, _ in requests if q == 1)
    ctx = ForwardContext(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        kv_caches=[kv],
        block_size=block_size,
        query_start_loc=starts,
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens),
        block_tables=tables[:, :width],
        num_decodes=num_decodes,
    )
    num_tokens = starts[-1]
    # q as the model makes it: a view into a wider [T, Hq + Hkv, D] tensor (row-strided).
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, generator=g)
    q = qk[:, :num_heads]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    return q, k, v, kv, ctx


def both_paths(
    kernel,
    requests,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    dtype=torch.float32,
    kv_dtype=None,
    block_size=BLOCK_SIZE,
    window=None,
    softcap=None,
):
    q, k, v, kv, ctx = make_batch(
        requests, num_heads, num_kv_heads, head_dim, block_size=block_size
    )
    q, k, v = (t.to(dtype) for t in (q, k, v))
    kv = kv.to(kv_dtype or dtype)
    ctx.kv_caches = [kv]
    scale = head_dim**-0.5
    torch_plan = build_attention_plan(ctx, dtype)
    ref = paged_attention(q, k, v, kv.clone(), ctx.slot_mapping, torch_plan, scale, window, softcap)
    plan = build_attention_plan(ctx, dtype, kernel)
    out = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, scale, window, softcap)
    return out, ref, plan


DECODES = [(1, c) for c in (0, 1, 14, 15, 16, 17, 31, 33, 200, 450)]


@pytest.mark.parametrize("threads", [1, 2])
def test_decodes_match_torch_path(kernel, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, ref, plan = both_paths(kernel, DECODES)
    finally:
        torch.set_num_threads(previous)
    assert plan.native is not None and plan.native.reqs.tolist() == list(range(len(DECODES)))
    assert plan.decode_tiles == [] and plan.prefills == []
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [4, 8, 32, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_decodes_match_torch_path_at_other_block_sizes(kernel, block_size, kv_dtype):
    """Blocks of 4 and 8 (the 16-key chunks of the decode path cut short), 32 and 64 (two and
    four chunks per block); a 5-query request too."""
    out, ref, _ = both_paths(kernel, DECODES + [(5, 30)], kv_dtype=kv_dtype, block_size=block_size)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_bfloat16_matches_torch_path(kernel):
    """bf16 cache and queries, fp32 scores and sums inside; the output rounded to bf16."""
    out, ref, plan = both_paths(kernel, DECODES + [(5, 30), (2, 0)], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and plan.native.reqs.numel() == len(DECODES) + 2
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_kernel_from_another_source(kernel, tmp_path):
    """load_paged_attention(source=...) builds a paged_attention.c from elsewhere with the headers
    beside it (how benchmarks/attention_layer.py --baseline times an older revision's kernel): a
    copy there is a second library, and gives the same bits as the package's own build."""
    other = load_paged_attention(source=copied_source("paged_attention.c", tmp_path))
    address = lambda build: ctypes.cast(build.fn, ctypes.c_void_p).value  # noqa: E731
    assert address(other) != address(kernel)  # two libraries loaded side by side
    out, _, _ = both_paths(kernel, DECODES + [(5, 30)])
    again, _, _ = both_paths(other, DECODES + [(5, 30)])
    assert torch.equal(out, again)


def test_float16_cache_under_float32_queries_matches_torch_path(kernel):
    """fp16 K/V (--kv-cache-dtype float16) under fp32 queries: both paths attend over the values
    as the cache holds them (rounded to fp16, this step's too), in fp32."""
    out, ref, plan = both_paths(kernel, DECODES + [(5, 30), (2, 0)], kv_dtype=torch.float16)
    assert out.dtype == torch.float32 and plan.native.reqs.numel() == len(DECODES) + 2
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    fp32, _, _ = both_paths(kernel, DECODES + [(5, 30), (2, 0)])
    assert 0 < (out - fp32).abs().max() < 5e-3  # the rounding, and nothing more


def test_float16_cache_without_f16c_matches_torch_path():
    """The kernel built for plain x86-64 (no F16C) converts fp16 K/V by hand: the same results."""
    from tokenbus.utils.cpu import CpuFeatures, _capped

    detected = CpuFeatures.detect()
    if not detected.is_x86 or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("the baseline x86-64 build needs an x86-64 CPU and a C compiler")
    baseline = load_paged_attention(CpuFeatures(_capped(detected.flags, "baseline"), "baseline"))
    out, ref, plan = both_paths(baseline, DECODES + [(5, 30)], kv_dtype=torch.float16)
    assert plan.native is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "heads",
    [
        (9, 3, 64),
        (4, 4, 32),
        (8, 2, 128),
        (6, 1, 48),
        (8, 2, 64),
        (2, 2, 64),
        (14, 2, 64),
        (16, 2, 64),
        (18, 2, 64),
    ],
)
def test_head_layouts_match_torch_path(kernel, heads):
    """GQA group sizes 1/2/3/4/6/7/8/9, the specialised head sizes 64/128 and the generic one (32,
    48); few requests (a work item per KV head) and many (a work item per request). On AVX-512,
    decodes of head size 64 with groups up to 8 take their own path (attend_decode64)."""
    for requests in (DECODES[:3], DECODES * 2):
        out, ref, _ = both_paths(kernel, requests, *heads)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_multi_query_requests_are_causal_and_match(kernel):
    """Spec-decode verification and short chunks (q_len <= NATIVE_MAX_QUERY_LEN) run natively,
    causal aligned to the end; a longer chunk takes the kernel's flash path in the same step
    (SDPA in bf16, which the flash path does not take)."""
    requests = [
        (1, 40),
        (1, 3),
        (5, 30),
        (2, 0),
        (attention.NATIVE_MAX_QUERY_LEN, 17),
        (attention.NATIVE_MAX_QUERY_LEN + 1, 20),
        (40, 0),
    ]
    out, ref, plan = both_paths(kernel, requests)
    assert plan.native.reqs.tolist() == [0, 1, 2, 3, 4]
    assert plan.native_long.reqs.tolist() == [5, 6] and plan.prefills == []
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    out, ref, plan = both_paths(kernel, requests, dtype=torch.bfloat16)
    assert plan.native.reqs.tolist() == [0, 1, 2, 3, 4] and plan.native_long is None
    assert [(p.start, p.end) for p in plan.prefills] == [(25, 42), (42, 82)]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# Prefill chunks: whole prompts (no context) and chunks after a context, lengths around the
# flash path's 16-key chunks and 32-query work items, decodes and a verification beside them.
LONG = [(1, 40), (5, 30), (17, 0), (31, 1), (33, 15), (64, 0), (100, 37), (47, 200), (300, 0)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 48), (16, 2, 64)])
def test_long_queries_take_the_flash_path_and_match(kernel, heads, kv_dtype, threads):
    """fp32 queries over fp32 or fp16 K/V, head sizes that are multiples of 16 (the specialised
    64 and 128, and others), GQA groups 1-8; the same results as the torch path's SDPA."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, ref, plan = both_paths(kernel, LONG, *heads, kv_dtype=kv_dtype)
    finally:
        torch.set_num_threads(previous)
    assert plan.native.reqs.tolist() == [0, 1] and plan.native_long.reqs.tolist() == list(
        range(2, len(LONG))
    )
    assert plan.prefills == []
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [4, 32])
def test_long_queries_at_other_block_sizes(kernel, block_size):
    """Cache blocks shorter and longer than the flash path's 16-key chunks."""
    out, ref, plan = both_paths(kernel, LONG, block_size=block_size, kv_dtype=torch.float16)
    assert plan.native_long is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_long_queries_outside_the_flash_path_take_sdpa(kernel):
    """A head size that is no multiple of 16 keeps SDPA for the long chunks."""
    assert not kernel.takes_long_queries(torch.float32, torch.float32, 40)
    assert not kernel.takes_long_queries(torch.bfloat16, torch.bfloat16, 64)
    out, ref, plan = both_paths(kernel, LONG, 5, 1, 40)
    assert plan.native_long is None and [p.seq_len for p in plan.prefills] == [
        q + c for q, c in LONG[2:]
    ]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cap", ["avx2", "baseline"])
def test_long_queries_on_capped_builds(cap):
    """The AVX2 build runs the flash path on its 8-lane halves; the plain x86-64 build has no
    vectors for it and leaves long chunks to SDPA."""
    from tokenbus.utils.cpu import CpuFeatures, _capped

    detected = CpuFeatures.detect()
    if not detected.is_x86 or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("the capped x86-64 builds need an x86-64 CPU and a C compiler")
    if cap == "avx2" and detected.isa not in ("avx2", "avx512"):
        pytest.skip(f"an AVX2 build needs AVX2 + FMA + F16C; this CPU is {detected.describe()}")
    capped = load_paged_attention(CpuFeatures(_capped(detected.flags, cap), cap))
    assert capped.takes_long_queries(torch.float32, torch.float16, 64) == (cap == "avx2")
    out, ref, plan = both_paths(capped, LONG, kv_dtype=torch.float16)
    assert (plan.native_long is not None) == (cap == "avx2")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("copies", [1, 9])
def test_a_query_row_does_not_depend_on_its_requests_query_count(kernel, kv_dtype, copies):
    """Row i of a 5-query request (a speculative verification) equals, bit for bit, decoding its
    token alone over the keys it sees; `copies` requests at once also takes the path where a
    work item holds every KV head."""
    q, k, v, kv, ctx = make_batch([(5, 30)] * copies, 9, 3, 64)
    kv = kv.to(kv_dtype)
    ctx.kv_caches = [kv]
    many = paged_attention(
        q, k, v, kv, ctx.slot_mapping, build_attention_plan(ctx, torch.float32, kernel), 0.125
    )
    # The same tokens as 5 * copies decodes of one query each, on the same cache and tables.
    tables = ctx.block_tables.repeat_interleave(5, dim=0)
    seq_lens = [30 + i + 1 for _ in range(copies) for i in range(5)]
    one_by_one = ForwardContext(
        positions=ctx.positions,
        slot_mapping=ctx.slot_mapping,
        kv_caches=[kv],
        block_size=BLOCK_SIZE,
        query_start_loc=list(range(5 * copies + 1)),
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens),
        block_tables=tables,
        num_decodes=5 * copies,
    )
    single = paged_attention(
        q,
        k,
        v,
        kv,
        ctx.slot_mapping,
        build_attention_plan(one_by_one, torch.float32, kernel),
        0.125,
    )
    assert torch.equal(many, single)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_decode_row_does_not_depend_on_the_work_split(kernel, kv_dtype):
    """Ten decodes at once make work items of every KV head (each block read once, head by head
    while it is in cache); a request alone splits its heads over the threads. The rows agree bit
    for bit."""
    q, k, v, kv, ctx = make_batch(DECODES, 9, 3, 64)
    kv = kv.to(kv_dtype)
    ctx.kv_caches = [kv]
    together = paged_attention(
        q, k, v, kv, ctx.slot_mapping, build_attention_plan(ctx, torch.float32, kernel), 0.125
    )
    for i in range(len(DECODES)):
        seq = ctx.seq_lens[i : i + 1]
        alone = ForwardContext(
            positions=ctx.positions[i : i + 1],
            slot_mapping=ctx.slot_mapping[i : i + 1],
            kv_caches=[kv],
            block_size=BLOCK_SIZE,
            query_start_loc=[0, 1],
            seq_lens=seq,
            seq_lens_t=torch.tensor(seq),
            block_tables=ctx.block_tables[i : i + 1],
            num_decodes=1,
        )
        out = paged_attention(
            q[i : i + 1],
            k[i : i + 1],
            v[i : i + 1],
            kv,
            ctx.slot_mapping[i : i + 1],
            build_attention_plan(alone, torch.float32, kernel),
            0.125,
        )
        assert torch.equal(out, together[i : i + 1]), i


def test_padding_requests_keep_zero_rows(kernel):
    """A padding request (seq_len 0) is left out of the kernel and its row stays zero."""
    q, k, v, kv, ctx = make_batch([(1, 20), (1, 5)], 9, 3, 64)
    ctx.seq_lens[1] = 0
    ctx.seq_lens_t[1] = 0
    plan = build_attention_plan(ctx, torch.float32, kernel)
    out = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, 0.125)
    assert plan.native.reqs.tolist() == [0]
    assert out[1].abs().sum() == 0 and out[0].abs().sum() > 0


@needs_cc
def test_select_attention_kernel():
    cpu = torch.device("cpu")
    assert select_attention_kernel("torch", cpu, torch.float32) is None
    assert select_attention_kernel("auto", cpu, torch.float16) is None  # fp32/bf16 only: torch path
    assert select_attention_kernel("auto", cpu, torch.float32) is not None
    assert select_attention_kernel("auto", cpu, torch.bfloat16) is not None
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_attention_kernel("flash", cpu, torch.float32)
    with pytest.raises(
        ValueError, match="'native' runs on CPU in float32 or bfloat16, not cpu torch.float16"
    ):
        select_attention_kernel("native", cpu, torch.float16)


def test_missing_compiler_falls_back_or_fails_clearly(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(tmp_path))  # nothing cached: a build is needed
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        load_paged_attention()
    with caplog.at_level(logging.WARNING):
        assert select_attention_kernel("auto", torch.device("cpu"), torch.float32) is None
    assert "using the torch path" in caplog.text
    with pytest.raises(ValueError, match="'native' is unavailable: no C compiler"):
        select_attention_kernel("native", torch.device("cpu"), torch.float32)


@needs_cc
def test_build_is_cached_and_reports_compile_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(tmp_path))
    good = tmp_path / "ok.c"
    good.write_text("int answer(void) { return 42; }\n")
    first = build_shared_object(good)
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build_shared_object(good) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    bad = tmp_path / "bad.c"
    bad.write_text("int broken( {\n")
    with pytest.raises(NativeBuildError, match="failed on bad.c"):
        build_shared_object(bad)
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [first.name]  # no leftovers


@needs_cc
def test_editing_an_included_header_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(tmp_path))
    header, source = tmp_path / "answer.h", tmp_path / "uses.c"
    header.write_text("#define ANSWER 42\n")
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    first = build_shared_object(source)
    header.write_text("#define ANSWER 43\n")
    second = build_shared_object(source)
    assert second != first and second.exists()


@needs_cc
def test_unwritable_cache_is_a_build_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(NativeBuildError, match="cannot write the kernel cache"):
        load_paged_attention()


def test_loading_the_kernel_keeps_denormals(kernel):
    """Built with -ffast-math but not linked with it: GCC would otherwise link crtfastmath.o,
    which turns on flush-to-zero for the whole process when the object is loaded."""
    tiny = torch.tensor([1e-40]) * 1.0
    assert tiny.item() != 0.0


@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_sliding_window_matches_torch_path(kernel, heads, kv_dtype, window):
    """Each query sees its last `window` keys: the decode path (head size 64: attend_decode64,
    else attend), short multi-query requests and the flash path all skip the keys before the
    window as the torch path masks them (windows below, at and past a block, and past every
    context)."""
    requests = DECODES + [(5, 30), (16, 40)] + LONG[2:]
    out, ref, plan = both_paths(kernel, requests, *heads, kv_dtype=kv_dtype, window=window)
    assert plan.native_long is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_soft_capped_scores_match_torch_path(kernel, heads, kv_dtype, window):
    """Gemma 2's soft-cap (scores -> 1.5 tanh(scores / 1.5), bending the random scores hard) on
    every path of the kernel: decodes (attend_decode64 at head size 64, else attend), short
    multi-query requests and the flash path, under a window too."""
    requests = DECODES + [(5, 30), (16, 40)] + LONG[2:]
    out, ref, plan = both_paths(
        kernel, requests, *heads, kv_dtype=kv_dtype, window=window, softcap=1.5
    )
    assert plan.native_long is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    uncapped, _, _ = both_paths(kernel, requests, *heads, kv_dtype=kv_dtype, window=window)
    assert (uncapped - out).abs().max() > 0.05  # the cap changed the output


def test_sliding_window_reads_no_block_before_it(kernel):
    """Blocks wholly before every query's window may be handed back (the hybrid KV cache): the
    kernel gives the same output with those table entries pointing at the null block."""
    requests = [(1, 200), (1, 90), (3, 100), (40, 120)]
    q, k, v, kv, ctx = make_batch(requests, 8, 2, 64)
    scale, window = 64**-0.5, 20
    plan = build_attention_plan(ctx, torch.float32, kernel)
    out = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, scale, window)
    tables = ctx.block_tables.clone()
    for r, (_, ctx_len) in enumerate(requests):
        first_key = max(ctx_len + 1 - window, 0)  # of the request's first query
        tables[r, : first_key // BLOCK_SIZE] = 0
    ctx.block_tables = tables
    plan = build_attention_plan(ctx, torch.float32, kernel)
    again = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, scale, window)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def dense_reference(q, kv, ctx, scale, window=None, sinks=None):
    """Attention of q [T, Hq, D] over each request's keys gathered from kv (this step's K/V
    already written), in float64: causal aligned to the end, a `window`, and `sinks` [Hq] as
    HF's gpt-oss eager attention adds them (a column of the head's sink, unscaled, joined to
    the scores for the softmax, then dropped)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = kv.shape[3], kv.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = ctx.query_start_loc
    for r, seq_len in enumerate(ctx.seq_lens):
        q_len = starts[r + 1] - starts[r]
        ids = ctx.block_tables[r, : -(-seq_len // block_size)]
        keys, values = kv[:, ids].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len].double()
        group = num_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("lhd,shd->hls", q[starts[r] : starts[r + 1]].double(), keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len)[None, :, None]
        key_pos = torch.arange(seq_len)[None, None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[starts[r] : starts[r + 1]] = torch.einsum("hls,shd->lhd", probs, values)
    return out


def random_sinks(num_heads: int, seed: int = 5) -> torch.Tensor:
    """Sinks of the scores' size (~N(0, 1) here) and up: they take a visible share of a short
    row's softmax, and nearly all of one key's."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_heads, generator=g) * 2 + 1


# Decodes at block edges, a verification, a short chunk, whole prompts and chunks after a cached
# prefix (the flash path in fp32; SDPA spans in bf16).
SINK_REQUESTS = [(1, c) for c in (0, 1, 15, 16, 33, 200)] + [(5, 30), (16, 40)]
SINK_REQUESTS += [(17, 0), (33, 15), (64, 0)]


def sink_paths(kernel, heads, dtype=torch.float32, kv_dtype=None, window=None, sinks=None):
    """SINK_REQUESTS on the kernel's plan and on the torch path's, and the dense reference over
    the cache as the kernel's step left it: (native, torch, reference, scale, q, kv, ctx,
    plan)."""
    q, k, v, kv, ctx = make_batch(SINK_REQUESTS, *heads)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    kv = kv.to(kv_dtype or dtype)
    ctx.kv_caches = [kv]
    scale = heads[2] ** -0.5
    torch_plan = build_attention_plan(ctx, dtype)
    ref = paged_attention(
        q, k, v, kv.clone(), ctx.slot_mapping, torch_plan, scale, window, sinks=sinks
    )
    plan = build_attention_plan(ctx, dtype, kernel)
    out = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, scale, window, sinks=sinks)
    dense = dense_reference(q.float(), kv.float(), ctx, scale, window, sinks=sinks)
    return out, ref, dense, scale, q.float(), kv.float(), ctx, plan


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_attention_sinks_match_a_dense_reference(kernel, heads, window):
    """gpt-oss's sinks on every path of the kernel (attend_decode64 at head size 64, attend
    otherwise, the flash path for the long chunks) and of the torch path (decode tiles,
    prefill spans with and without a cached prefix): out = sum_j e^(s_j) v_j / (e^sink +
    sum_j e^(s_j)), the sink neither scaled nor left out."""
    sinks = random_sinks(heads[0])
    out, torch_out, ref, scale, q, kv, ctx, plan = sink_paths(
        kernel, heads, window=window, sinks=sinks
    )
    assert plan.native is not None and plan.native_long is not None
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch_out.double(), ref, atol=2e-5, rtol=1e-4)
    for wrong in (None, sinks * scale):  # a sink left out, or scaled like a score
        other = dense_reference(q, kv, ctx, scale, window, sinks=wrong)
        assert (out.double() - other).abs().max() > 0.05


def test_attention_sinks_in_bfloat16_and_over_a_float16_cache(kernel):
    """bf16 queries and cache (the kernel's decode path, SDPA spans for the long chunks), and
    fp16 K/V under fp32 queries (every path of the kernel): each against the reference over the
    cache as written."""
    sinks = random_sinks(8)
    out, torch_out, ref, *_, plan = sink_paths(kernel, (8, 2, 64), torch.bfloat16, sinks=sinks)
    assert plan.native_long is None and plan.prefills
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(torch_out.double(), ref, atol=3e-2, rtol=3e-2)
    out, torch_out, ref, *_, plan = sink_paths(
        kernel, (8, 2, 64), kv_dtype=torch.float16, window=9, sinks=sinks
    )
    assert plan.native_long is not None
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch_out.double(), ref, atol=2e-5, rtol=1e-4)


def test_sinks_enter_only_the_max_and_the_sum(kernel):
    """Sinks far below every score add e^(sink - max) = 0 to each sum and never win the max: the
    kernel's rows then equal, bit for bit, its rows without sinks (the sink changes nothing
    else on any path). Sinks of the wrong shape or type are refused."""
    heads = (9, 3, 64)
    silent = torch.full((heads[0],), -1e4)
    out, *_ = sink_paths(kernel, heads, sinks=silent)
    plain, *_ = sink_paths(kernel, heads)
    assert torch.equal(out, plain)
    with pytest.raises(ValueError, match=r"sinks must be contiguous float32 \[9\] on cpu"):
        sink_paths(kernel, heads, sinks=silent.double())
    with pytest.raises(ValueError, match=r"got torch.float32 \[3\]"):
        sink_paths(kernel, heads, sinks=silent[:3])
