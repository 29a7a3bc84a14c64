"""The Triton paged-attention kernels against a dense reference, on a GPU or in Triton's
interpreter (tests/fixtures/triton_device.py)."""

import pytest
import torch
from tests.fixtures.triton_device import (
    BF16_DOT_ON_GPU_ONLY,
    DEVICE,
    skip_module_without_triton,
)

skip_module_without_triton()

from tokenbus.model import triton_attention  # noqa: E402  (after the interpreter check)

BLOCK_SIZE = 16


def _make_step(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, kv_dtype=None, seed=0):
    """A paged cache holding each request's context at shuffled blocks, and this step's q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(q_lens)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3  # block 0: the null block; a few spare
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(q_lens), max(blocks_per_req + [1]), dtype=torch.int64)
    taken = 0
    for r, n in enumerate(blocks_per_req):
        tables[r, :n] = order[taken : taken + n]
        taken += n
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots, starts = [], [0]
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + q_len)
    to = dict(device=DEVICE)
    return (
        q.to(dtype).to(**to),
        k.to(dtype).to(**to),
        v.to(dtype).to(**to),
        cache.to(kv_dtype or dtype).to(**to),
        tables.to(**to),
        torch.tensor(starts, dtype=torch.int64, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
        torch.tensor(slots, dtype=torch.int64, device=DEVICE),
    )


def _reference(q, cache, tables, starts, seq_lens, scale, window=None, softcap=None, sinks=None):
    """Dense causal attention per request over its gathered keys, in float64 (a `window`: each
    query's last `window` keys; `softcap`: scores soft-capped before the mask, as HF's eager
    attention does; `sinks` [Hq]: a column of each head's sink joined to its scores for the
    softmax, then dropped, as HF's gpt-oss eager attention does)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    num_heads, num_kv_heads = q.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    for r in range(len(seq_lens)):
        start, end, seq_len = int(starts[r]), int(starts[r + 1]), int(seq_lens[r])
        if end == start or seq_len == 0:
            continue
        ids = tables[r, : -(-seq_len // BLOCK_SIZE)].cpu()
        kv = cache.cpu()[:, ids].reshape(2, -1, num_kv_heads, q.shape[2])[:, :seq_len].double()
        keys = kv[0].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = kv[1].repeat_interleave(group, dim=1)
        queries = q[start:end].cpu().double()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", queries, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        key_pos = torch.arange(seq_len)[None, None, :]
        scores.masked_fill_(key_pos > q_pos[None, :, None], -1e300)
        if window is not None:
            scores.masked_fill_(key_pos <= q_pos[None, :, None] - window, -1e300)
        if sinks is not None:
            column = sinks.cpu().double()[:, None, None].expand(*scores.shape[:2], 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, values)
    return out


def _run(
    q_lens,
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    split_kv=1,
    kv_dtype=None,
    **options,  # window, softcap, sinks
):
    q, k, v, cache, tables, starts, lens, slots = _make_step(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, kv_dtype
    )
    triton_attention.write_kv(cache, k, v, slots)  # rounded to the cache's dtype
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(
        q, cache, tables, starts, lens, scale, max(q_lens), split_kv=split_kv, **options
    )
    ref = _reference(q, cache, tables, starts, lens, scale, **options)
    return out, ref, (cache, k, v, slots)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "q_lens, seq_lens",
    [
        ([1, 1, 1], [1, 17, 40]),  # decodes: one key, a block boundary + 1, several blocks
        ([5], [5]),  # a whole prompt in one chunk
        ([7, 1, 20], [23, 16, 52]),  # a chunk over a cached prefix, a decode, a long chunk
        ([3, 1], [35, 33]),  # spec-decode verification (1 + 2 drafts) beside a decode
    ],
)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
def test_matches_dense_reference(q_lens, seq_lens, num_heads, num_kv_heads):
    out, ref, _ = _run(q_lens, seq_lens, num_heads, num_kv_heads, 64, torch.float32)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [
        (torch.float16, torch.float16),
        pytest.param(torch.bfloat16, torch.bfloat16, marks=BF16_DOT_ON_GPU_ONLY),
        (torch.float32, torch.float16),  # --kv-cache-dtype below the model's dtype
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float8_e4m3fn),  # --kv-cache-dtype fp8: read in place
        (torch.float16, torch.float8_e5m2),
    ],
)
def test_half_precision(dtype, kv_dtype):
    out, ref, _ = _run([1, 9], [30, 41], 4, 2, 64, dtype, kv_dtype=kv_dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


def test_head_size_128_and_split_decode():
    out, ref, _ = _run([1, 1, 6], [70, 3, 40], 4, 2, 128, torch.float32, split_kv=4)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)


def test_split_decode_equals_unsplit():
    split, _, _ = _run([1, 1], [90, 17], 8, 2, 64, torch.float32, split_kv=8)
    whole, ref, _ = _run([1, 1], [90, 17], 8, 2, 64, torch.float32)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(whole.cpu().double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 20])
@pytest.mark.parametrize("split_kv", [1, 4])
def test_sliding_window(window, split_kv):
    # Decodes (one past a block edge, one long), a chunk over a cached prefix, a whole prompt
    # longer than the window: windows inside one block and across blocks.
    q_lens, seq_lens = [1, 1, 7, 20], [17, 90, 30, 20]
    out, ref, _ = _run(q_lens, seq_lens, 4, 2, 64, torch.float32, split_kv, window=window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)


def test_sliding_window_never_reads_the_blocks_before_it():
    """A hybrid KV cache frees a windowed group's blocks once every query is past them: the
    tables may point those at anything. Here they hold NaN, and no output sees one."""
    q_lens, seq_lens, window = [1, 3, 1], [70, 52, 33], 20
    q, k, v, cache, tables, starts, lens, slots = _make_step(
        q_lens, seq_lens, 4, 2, 64, torch.float32
    )
    triton_attention.write_kv(cache, k, v, slots)
    ref = _reference(q, cache, tables, starts, lens, 0.125, window=window)
    poison = cache.shape[1] - 1  # a spare block no table holds
    cache[:, poison] = float("nan")
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        unseen = (seq_len - q_len + 1 - window) // BLOCK_SIZE  # blocks wholly before it
        tables[r, :unseen] = poison
    for split_kv in (1, 4):
        out = triton_attention.paged_attention(
            q, cache, tables, starts, lens, 0.125, max(q_lens), split_kv=split_kv, window=window
        )
        torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_softcapped_scores(window):
    # Scores of a few units against a cap of 2: tanh is far from linear there.
    q_lens, seq_lens = [1, 6, 1], [40, 6, 3]
    out, ref, _ = _run(q_lens, seq_lens, 4, 1, 64, torch.float32, softcap=2.0, window=window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)
    plain, _, _ = _run(q_lens, seq_lens, 4, 1, 64, torch.float32, window=window)
    assert not torch.allclose(out, plain, atol=1e-3)  # the cap changed the output


def _sinks(num_heads: int) -> torch.Tensor:
    """Sinks of the scores' size and up: a visible share of every short row's softmax."""
    g = torch.Generator().manual_seed(5)
    return (torch.randn(num_heads, generator=g) * 2 + 1).to(DEVICE)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("split_kv", [1, 4])
def test_attention_sinks(window, split_kv):
    """gpt-oss's sinks: decodes (one key, a block edge + 1, several blocks: split 0's partial
    carries the sink), a chunk over a cached prefix, a whole prompt, GQA 4; neither scaled nor
    left out."""
    q_lens, seq_lens = [1, 1, 1, 7, 20], [1, 17, 90, 30, 20]
    sinks = _sinks(8)
    out, ref, (cache, *_) = _run(
        q_lens, seq_lens, 8, 2, 64, torch.float32, split_kv, window=window, sinks=sinks
    )
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)
    # the same step's queries and tables (seeded), over the cache as the kernel wrote it
    q, _, _, _, tables, starts, lens, _ = _make_step(q_lens, seq_lens, 8, 2, 64, torch.float32)
    for wrong in (None, sinks * 64**-0.5):  # a sink left out, or scaled like a score
        other = _reference(q, cache, tables, starts, lens, 64**-0.5, window, sinks=wrong)
        assert (out.cpu().double() - other).abs().max() > 0.05


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_ON_GPU_ONLY)]
)
def test_attention_sinks_in_half_precision(dtype):
    out, ref, _ = _run([1, 9], [30, 41], 4, 2, 64, dtype, sinks=_sinks(4))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_is_written_as_the_torch_path_writes_it(kv_dtype):
    """Saturated at the type's largest finite value, then rounded, into the tokens' slots
    alone: on a GPU, the bytes of kv_quant.write_rows. Triton's interpreter rounds fp32 to fp8
    wrong where the mantissa carries into the exponent (0.49 -> 0.25), so on CPU the values
    are not compared."""
    from tokenbus.model import kv_quant

    _, k, v, cache, *_, slots = _make_step([3, 1], [3, 18], 2, 2, 64, torch.float32, kv_dtype)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 500.0, -70000.0])  # past e4m3's 448 (and e5m2's)
    before = cache.clone()
    triton_attention.write_kv(cache, k, v, slots)
    limit = kv_quant.FP8_MAX[kv_dtype]
    first = cache.view(2, -1, 2, 64)[0, slots[0], 0, :4].float()
    assert first.tolist()[:2] == [limit, -limit] and first.abs().max() == limit
    untouched = torch.ones(cache.view(2, -1, 2, 64).shape[1], dtype=torch.bool)
    untouched[slots.cpu()] = False
    as_bytes = cache.view(torch.uint8).view(2, -1, 2, 64)
    assert torch.equal(
        as_bytes[:, untouched], before.view(torch.uint8).view(2, -1, 2, 64)[:, untouched]
    )
    if DEVICE == "cuda":
        expected = before.clone()
        flat = expected.view(2, -1, 2, 64)
        kv_quant.write_rows(flat[0], slots, k)
        kv_quant.write_rows(flat[1], slots, v)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_q8_0_cache_is_refused():
    cache = torch.zeros(2, 4, 16, 1, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not one the Triton kernels read"):
        triton_attention.write_kv(cache, *[torch.zeros(1, 1, 64)] * 2, torch.zeros(1).long())


def test_write_kv_stores_each_token_at_its_slot_and_skips_negative_slots():
    _, _, (cache, k, v, slots) = _run([2, 1], [2, 19], 2, 2, 64, torch.float32)
    flat = cache.view(2, -1, 2, 64)
    torch.testing.assert_close(flat[0, slots], k)
    torch.testing.assert_close(flat[1, slots], v)
    before = cache.clone()
    triton_attention.write_kv(cache, k + 1, v + 1, torch.full_like(slots, -1))
    assert torch.equal(cache, before)


def test_empty_request_and_padding_rows_are_left_alone():
    # Request 1 has no query this step (q_len 0); token row 3 belongs to no request.
    q, _, _, cache, tables, starts, lens, _ = _make_step(
        [2, 0, 1], [2, 0, 5], 2, 2, 64, torch.float32
    )
    q = torch.cat([q, torch.ones_like(q[:1])])
    out = torch.full_like(q, 7.0)
    triton_attention.paged_attention(q, cache, tables, starts, lens, 0.125, 2, out=out)
    ref = _reference(q, cache, tables, starts, lens, 0.125)
    torch.testing.assert_close(out[:3].cpu().double(), ref[:3], atol=2e-5, rtol=2e-5)
    assert torch.all(out[3] == 7.0)


def test_refuses_a_cache_of_the_wrong_shape():
    with pytest.raises(ValueError, match="kv_cache must be"):
        triton_attention.write_kv(
            torch.zeros(2, 4, 16, 64),
            *[torch.zeros(1, 1, 64)] * 2,
            torch.zeros(1, dtype=torch.int64),
        )
