"""Attention backends: eager metadata and the static plans of captured steps (padded uniform
batches)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tests.fixtures.triton_device import needs_triton_on_cpu
from tests.model.test_native_attention import (
    BLOCK_SIZE,
    SINK_REQUESTS,
    dense_reference,
    make_batch,
    random_sinks,
)

from tokenbus.model import ForwardContext
from tokenbus.model.attention import paged_attention
from tokenbus.model.attention_backend import (
    TorchAttentionBackend,
    select_attention_backend,
    triton_problem,
)


def backends() -> list:
    found = [TorchAttentionBackend(torch.float32)]
    if shutil.which(os.environ.get("CC", "cc")) is not None:
        found.append(select_attention_backend("native", torch.device("cpu"), torch.float32))
    if triton_problem("cpu") is None:  # Triton's interpreter (tests/conftest.py)
        found.append(select_attention_backend("triton", torch.device("cpu"), torch.float32))
    return found


def pad_uniform(ctx: ForwardContext, q, k, v, padded_reqs: int, q_len: int, width: int):
    """`ctx` (a uniform batch) padded to `padded_reqs` requests of q_len tokens, as the worker
    pads a replayed step: padding tokens at positions 0.. of the null block, tables of zeros
    at the full `width`."""
    num_reqs, num_tokens = ctx.num_reqs, ctx.num_tokens
    pad_tokens = (padded_reqs - num_reqs) * q_len
    pad_positions = torch.arange(q_len).repeat(padded_reqs - num_reqs)
    tables = torch.zeros(padded_reqs, width, dtype=torch.int64)
    tables[:num_reqs, : ctx.block_tables.shape[1]] = ctx.block_tables
    seq_lens = ctx.seq_lens + [q_len] * (padded_reqs - num_reqs)
    padded = ForwardContext(
        positions=torch.cat([ctx.positions, pad_positions]),
        slot_mapping=torch.cat([ctx.slot_mapping, pad_positions % BLOCK_SIZE]),  # block 0
        kv_caches=ctx.kv_caches,
        block_size=BLOCK_SIZE,
        query_start_loc=[r * q_len for r in range(padded_reqs + 1)],
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens),
        block_tables=tables,
        num_decodes=padded_reqs if q_len == 1 else 0,
        query_start_loc_t=torch.arange(padded_reqs + 1) * q_len,
    )
    g = torch.Generator().manual_seed(7)
    extra = [torch.randn(pad_tokens, *t.shape[1:], generator=g) for t in (q, k, v)]
    assert padded.num_tokens == num_tokens + pad_tokens
    return padded, *(torch.cat([t, e]) for t, e in zip((q, k, v), extra))


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("q_len", [1, 3])
def test_static_plan_of_a_padded_batch_matches_eager(backend, q_len):
    """Real rows equal the eager plan's; padding rows are finite and write only the null block."""
    requests = [(q_len, c) for c in (0, 5, 16, 40)]
    q, k, v, kv, ctx = make_batch(requests, 9, 3, 64)
    ref = paged_attention(q, k, v, kv.clone(), ctx.slot_mapping, backend.build_metadata(ctx), 0.125)
    padded, pq, pk, pv = pad_uniform(
        ctx, q, k, v, padded_reqs=7, q_len=q_len, width=ctx.block_tables.shape[1] + 3
    )
    before = kv.clone()
    plan = backend.prepare_for_capture(padded)
    expected = {"native": "TorchDecodePlan", "torch": "TorchDecodePlan", "triton": "TritonPlan"}
    assert type(plan).__name__ == expected[backend.name]
    plan = backend.prepare_for_replay(padded, padded.num_tokens)
    out = paged_attention(pq, pk, pv, kv, padded.slot_mapping, plan, 0.125)
    n = ctx.num_tokens
    torch.testing.assert_close(out[:n], ref, atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()
    written = kv.view(2, -1, 3, 64).ne(before.view(2, -1, 3, 64)).any(-1).any(-1).any(0)  # [slots]
    allowed = set(ctx.slot_mapping.tolist()) | set(range(BLOCK_SIZE))  # own slots + the null block
    assert set(written.nonzero().flatten().tolist()) <= allowed


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("window", [None, 7])
def test_eager_plans_take_attention_sinks(backend, window):
    """gpt-oss's sinks through the attention seam on each backend's eager plan (the torch
    path's decode tiles and prefill spans, the native kernel, Triton's): GQA, decodes at block
    edges, chunks after a cached prefix, whole prompts; the dense reference's rows."""
    sinks = random_sinks(8)
    q, k, v, kv, ctx = make_batch(SINK_REQUESTS, 8, 2, 32)
    plan = backend.build_metadata(ctx)
    out = paged_attention(q, k, v, kv, ctx.slot_mapping, plan, 32**-0.5, window, sinks=sinks)
    ref = dense_reference(q, kv, ctx, 32**-0.5, window, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("q_len", [1, 3])
def test_static_plans_take_attention_sinks(backend, q_len):
    """A captured step's static plan with sinks (TorchDecodePlan folds the G heads of a KV head
    into rows: each row its own head's sink; TritonPlan) gives the reference's rows, under a
    window too."""
    sinks = random_sinks(9)
    requests = [(q_len, c) for c in (0, 5, 16, 40)]
    q, k, v, kv, ctx = make_batch(requests, 9, 3, 64)
    padded, pq, pk, pv = pad_uniform(
        ctx, q, k, v, padded_reqs=6, q_len=q_len, width=ctx.block_tables.shape[1] + 2
    )
    backend.prepare_for_capture(padded)
    plan = backend.prepare_for_replay(padded, padded.num_tokens)
    for window in (None, 6):
        out = paged_attention(pq, pk, pv, kv, padded.slot_mapping, plan, 0.125, window, None, sinks)
        ref = dense_reference(q, kv, ctx, 0.125, window, sinks=sinks)
        torch.testing.assert_close(out[: ctx.num_tokens].double(), ref, atol=2e-5, rtol=1e-4)
        assert torch.isfinite(out).all()


def test_sdpa_with_sinks_is_hfs_gpt_oss_eager_attention():
    """attention.sdpa with sinks against HF gpt-oss's eager attention: GQA, a causal mask
    aligned to the end (a chunk after context) and an additive mask, bf16 too."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from tokenbus.model.sdpa import sdpa

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 16, generator=g)  # [B, Hq, Lq, D]
    k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(2))  # [B, Hkv, Lk, D]
    visible = torch.ones(5, 9, dtype=torch.bool).tril(9 - 5)
    mask = torch.zeros(5, 9).masked_fill(~visible, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        q, k, v, mask = (t.to(dtype) for t in (q, k, v, mask))
        ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
        ref = ref.transpose(1, 2)  # HF returns [B, Lq, H, D]
        sinks = module.sinks.view(-1, 1, 1)  # [Hq, 1, 1]: each head's, for each of its queries
        ours = sdpa(q, k, v, is_causal=True, scale=0.25, enable_gqa=True, sinks=sinks)
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
        ours = sdpa(q, k, v, mask, scale=0.25, enable_gqa=True, sinks=sinks)
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    plain = sdpa(q.float(), k.float(), v.float(), is_causal=True, scale=0.25, enable_gqa=True)
    assert (plain - ref.float()).abs().max() > 0.1  # the sinks take a share of each row


def test_replay_needs_the_captured_shape():
    backend = TorchAttentionBackend(torch.float32)
    q, k, v, kv, ctx = make_batch([(1, 3), (1, 9)], 4, 2, 32)
    with pytest.raises(ValueError, match="no step was captured for 2 tokens"):
        backend.prepare_for_replay(ctx, 2)
    with pytest.raises(ValueError, match="must be padded to 4 tokens"):
        backend.prepare_for_replay(ctx, 4)
    _, _, _, _, mixed = make_batch([(1, 3), (2, 9)], 4, 2, 32)
    with pytest.raises(ValueError, match="uniform batch"):
        backend.prepare_for_capture(mixed)


def test_model_forward_reads_metadata_it_never_builds(tiny_llama_dir):
    from tests.fixtures.paged import PagedKV

    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.worker.model_builder import load_model

    src = resolve_model(str(tiny_llama_dir))
    model = load_model(src, load_arch(src), torch.float32, "cpu")
    input_ids, ctx = PagedKV.for_model(model).step([("a", [1, 2, 3])])
    ctx.attn_metadata = None
    with pytest.raises(ValueError, match="attn_metadata is not set"), torch.inference_mode():
        model(input_ids, ctx)


@needs_triton_on_cpu
def test_triton_splits_only_the_keys_of_decode_only_steps(monkeypatch):
    """Split-K is for a step of decodes alone: beside a prefill chunk the GPU has work anyway,
    and the fp32 partials would be sized by every token of the chunk."""
    from tokenbus.model import triton_attention

    monkeypatch.setattr(triton_attention, "decode_splits", lambda *args: 4)  # as on a GPU
    backend = select_attention_backend("triton", torch.device("cpu"), torch.float32)
    long = backend.MIN_SPLIT_CONTEXT + 40
    *_, decodes = make_batch([(1, long), (1, 9)], 4, 2, 32)
    *_, mixed = make_batch([(1, long), (5, 9)], 4, 2, 32)
    *_, short = make_batch([(1, 30), (1, 9)], 4, 2, 32)
    assert backend.build_metadata(decodes).split_kv == 4
    assert backend.build_metadata(mixed).split_kv == 1
    assert backend.build_metadata(short).split_kv == 1


def test_decode_tiles_fit_their_device_budget():
    """Runs of decode rows padded to their longest request fit the budget: a cache-sized one
    on CPU, a launch-saving one on a GPU (the torch path there, when Triton cannot run)."""
    from tokenbus.model.attention import DECODE_TILE_BYTES, GPU_DECODE_TILE_BYTES, _tile_rows

    # 1 KiB a key, blocks of 16: each request of 17..32 keys gathers 2 blocks, 32 KiB.
    assert _tile_rows([32, 32, 20, 32], 16, 1024, budget=64 << 10) == [(0, 2, 2), (2, 4, 2)]
    # 8B-shaped keys (8 KV heads x 128 x bf16, K and V: 4 KiB) at 2K context, batch 64.
    cpu = _tile_rows([2048] * 64, 16, 4096, DECODE_TILE_BYTES)
    gpu = _tile_rows([2048] * 64, 16, 4096, GPU_DECODE_TILE_BYTES)
    assert (len(cpu), len(gpu)) == (64, 2)
