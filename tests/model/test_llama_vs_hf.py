"""Our Llama-family model through the paged KV cache vs HF transformers on the same weights
(fp32)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from tests.fixtures.paged import PagedKV
from tests.fixtures.tiny_models import cached_tiny_model
from transformers import AutoModelForCausalLM

from tokenbus.loader import load_arch, resolve_model
from tokenbus.model import ForwardContext, LlamaForCausalLM, attention, get_model_class
from tokenbus.model.kernel_plan import KernelRequest, apply_kernels
from tokenbus.model.qwen3 import Qwen3ForCausalLM
from tokenbus.model.smollm3 import NO_ROPE, ROPE, SmolLM3ForCausalLM
from tokenbus.worker.model_builder import load_model

ATOL = 1e-4
SEQS = {  # token ids; a few long enough to span several 4-token blocks
    "a": [17, 803, 4211, 9, 15000, 77, 2048, 3, 31000],
    "b": [5, 6, 7, 8, 9, 10],
    "c": [101, 202, 303, 404, 505, 606, 707, 808, 909, 1010, 1111, 1212, 1313, 1414],
    "d": [40000, 41000, 42000, 43000, 44000, 45000, 46000],
}


def load_pair(path, attention_backend: str = "auto") -> tuple[LlamaForCausalLM, torch.nn.Module]:
    src = resolve_model(str(path))
    ours = load_model(src, load_arch(src), torch.float32, "cpu", attention_backend)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(
    scope="module",
    params=[
        (arch, backend)
        for arch in ("llama", "qwen2", "mistral", "qwen3", "smollm3", "granite", "olmo2", "olmo3")
        for backend in ("torch", "native")
    ],
    ids="-".join,
)
def pair(request):
    arch, backend = request.param
    if backend == "native" and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    with torch.inference_mode():
        yield load_pair(cached_tiny_model(arch), backend)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def run(model, kv: PagedKV, batch, **kwargs) -> torch.Tensor:
    input_ids, ctx = kv.step(batch)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, ctx, **kwargs))


def test_full_prefill_matches_hf(pair):
    ours, hf = pair
    logits = run(ours, PagedKV.for_model(ours), [("c", SEQS["c"])])
    assert logits.dtype == torch.float32 and logits.shape == (14, 49152)
    torch.testing.assert_close(logits, hf_logits(hf, SEQS["c"]), atol=ATOL, rtol=0)


def test_token_by_token_decode_matches_hf(pair):
    ours, hf = pair
    ids, kv = SEQS["c"], PagedKV.for_model(ours, block_size=4)
    rows = [run(ours, kv, [("c", ids[:3])])]
    rows += [run(ours, kv, [("c", [token])]) for token in ids[3:]]
    assert kv.block_ids["c"] != sorted(kv.block_ids["c"])  # a shuffled, non-contiguous block table
    torch.testing.assert_close(torch.cat(rows), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_prefill_chunks_matches_hf(pair):
    ours, hf = pair
    a, b, c, d = (SEQS[k] for k in "abcd")
    kv = PagedKV.for_model(ours, block_size=4)
    first = run(ours, kv, [("c", c[:5]), ("a", a[:8]), ("b", b[:5])])
    # 2 decodes, a prefill chunk with 5 tokens of context, a fresh prompt
    second = run(ours, kv, [("a", a[8:9]), ("b", b[5:6]), ("c", c[5:11]), ("d", d)])
    third = run(ours, kv, [("c", c[11:])])  # a multi-token query over context (spec-decode verify)
    ref = {k: hf_logits(hf, SEQS[k]) for k in "abcd"}
    torch.testing.assert_close(
        first, torch.cat([ref["c"][:5], ref["a"][:8], ref["b"][:5]]), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        second,
        torch.cat([ref["a"][8:9], ref["b"][5:6], ref["c"][5:11], ref["d"]]),
        atol=ATOL,
        rtol=0,
    )
    torch.testing.assert_close(third, ref["c"][11:], atol=ATOL, rtol=0)


def test_blocks_written_this_step_are_read_by_another_request(pair):
    """Prefix caching: b and e reuse the 2 blocks a writes in the same step (write before read)."""
    ours, hf = pair
    prefix, kv = SEQS["a"][:8], PagedKV.for_model(ours, block_size=4)
    kv.share_prefix("b", "a", num_blocks=2)
    kv.share_prefix("e", "a", num_blocks=2)
    logits = run(ours, kv, [("e", [99]), ("a", SEQS["a"]), ("b", [11, 12, 13])])  # e decodes first
    torch.testing.assert_close(logits[0], hf_logits(hf, prefix + [99])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1:10], hf_logits(hf, SEQS["a"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        logits[10:], hf_logits(hf, prefix + [11, 12, 13])[8:], atol=ATOL, rtol=0
    )


def test_decodes_in_several_tiles_match_hf(pair, monkeypatch):
    """Tiny tiles: decodes of different lengths split into runs, each padded to its own longest."""
    ours, hf = pair
    if ours.attention_kernel is not None:
        pytest.skip("decode tiles are the torch path's")
    monkeypatch.setattr(
        attention, "DECODE_TILE_BYTES", 3 * 8 * ours.num_kv_heads * ours.head_dim * 4 * 2
    )
    kv = PagedKV.for_model(ours, block_size=4)
    run(ours, kv, [(k, SEQS[k][:-1]) for k in "cabd"])
    input_ids, ctx = kv.step([(k, SEQS[k][-1:]) for k in "cabd"])
    plan = attention.build_attention_plan(ctx, torch.float32)
    assert [(t.start, t.end, t.block_ids.shape[1]) for t in plan.decode_tiles] == [
        (0, 1, 4),
        (1, 3, 3),
        (3, 4, 2),
    ]
    with torch.inference_mode():
        logits = ours.compute_logits(ours(input_ids, ctx))
    ref = torch.stack([hf_logits(hf, SEQS[k])[-1] for k in "cabd"])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_padded_decode_rows_stay_finite_and_harmless(pair):
    """A captured-graph step pads decodes with rows of seq_len 0 writing to the null block
    (slot 0)."""
    ours, hf = pair
    kv = PagedKV.for_model(ours)
    run(ours, kv, [("a", SEQS["a"][:-1])])
    input_ids, ctx = kv.step([("a", SEQS["a"][-1:])])
    padded = ForwardContext(
        positions=torch.cat([ctx.positions, torch.zeros(1, dtype=torch.long)]),
        slot_mapping=torch.cat([ctx.slot_mapping, torch.zeros(1, dtype=torch.long)]),
        kv_caches=ctx.kv_caches,
        block_size=ctx.block_size,
        query_start_loc=[0, 1, 2],
        seq_lens=ctx.seq_lens + [0],
        seq_lens_t=torch.tensor(ctx.seq_lens + [0]),
        block_tables=torch.cat([ctx.block_tables, torch.zeros_like(ctx.block_tables[:1])]),
        num_decodes=2,
    )
    padded.attn_metadata = ours.attention_backend.build_metadata(padded)
    with torch.inference_mode():
        logits = ours.compute_logits(
            ours(torch.cat([input_ids, torch.zeros(1, dtype=torch.long)]), padded)
        )
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], hf_logits(hf, SEQS["a"])[-1], atol=ATOL, rtol=0)


def test_first_n_layers_is_the_truncated_model(pair):
    """num_layers=1: layer 0 + final norm + head (self-speculative draft); its K/V equal the full
    model's."""
    ours, hf = pair
    ids = SEQS["d"]
    draft_kv, full_kv = PagedKV.for_model(ours, seed=1), PagedKV.for_model(ours, seed=1)
    draft = run(ours, draft_kv, [("d", ids)], num_layers=1)
    run(ours, full_kv, [("d", ids)])
    with torch.inference_mode():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[
            1
        ]  # after layer 0
        # (Granite's logits are divided by its logits_scaling)
        ref = hf.lm_head(hf.model.norm(hidden))[0] / getattr(hf.config, "logits_scaling", 1.0)
    torch.testing.assert_close(draft, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(draft_kv.kv_caches[0], full_kv.kv_caches[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="num_layers"):
        run(ours, PagedKV.for_model(ours), [("d", ids)], num_layers=ours.num_layers + 1)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}),
        dict(attention_bias=True),  # Llama's attention_bias also adds an o_proj bias
        dict(tie_word_embeddings=True),
        dict(
            head_dim=32, num_key_value_heads=1
        ),  # head_dim != hidden / heads; 4 query heads per KV head
    ],
    ids=["llama3-rope", "linear-rope", "attention-bias", "tied-embeddings", "head-dim-32-mqa"],
)
def test_llama_variants_match_hf(overrides):
    ours, hf = load_pair(cached_tiny_model("llama", **overrides))
    ids, kv = SEQS["c"], PagedKV.for_model(ours)
    logits = torch.cat(
        [run(ours, kv, [("c", ids[:10])])] + [run(ours, kv, [("c", [t])]) for t in ids[10:]]
    )
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True, head_dim=16),  # head_dim = hidden / heads here
        dict(attention_bias=True, head_dim=32),  # q/k/v and o_proj biases
        dict(num_key_value_heads=1, head_dim=64),  # 4 query heads on one KV head
    ],
    ids=["tied-embeddings", "attention-bias", "mqa"],
)
def test_qwen3_variants_match_hf(overrides):
    """Qwen3's q/k norms under each variant, prefill then decode (its default head_dim, 128,
    runs in the `pair` tests)."""
    ours, hf = load_pair(cached_tiny_model("qwen3", **overrides))
    assert type(ours).__name__ == "Qwen3ForCausalLM" and ours.layers[0].self_attn.q_norm is not None
    ids, kv = SEQS["c"], PagedKV.for_model(ours)
    logits = torch.cat(
        [run(ours, kv, [("c", ids[:10])])] + [run(ours, kv, [("c", [t])]) for t in ids[10:]]
    )
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides,nope",
    [
        (dict(), (3,)),  # SmolLM3's default: every fourth layer
        (dict(no_rope_layers=[0, 1, 0, 1]), (0, 2)),
        (dict(num_hidden_layers=8, no_rope_layer_interval=2), (1, 3, 5, 7)),
        # Its NoPE layers slide (SmolLM3Config's layer_types): window 4, prompts of 14 tokens
        (dict(use_sliding_window=True, sliding_window=4), (3,)),
    ],
    ids=["every-fourth", "listed", "interval-2", "sliding-nope-layers"],
)
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_smollm3_nope_layers_match_hf(overrides, nope, backend):
    """NoPE layers read the identity table (cos 1, sin 0): HF's logits, prefill then decode;
    turning them as the others would is far off (the rotary matters at these positions)."""
    if backend == "native" and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    ours, hf = load_pair(cached_tiny_model("smollm3", **overrides), backend)
    assert isinstance(ours, SmolLM3ForCausalLM) and ours.arch.nope_layers == nope
    tables = [layer.self_attn.rope_table for layer in ours.layers]
    assert tables == [NO_ROPE if i in nope else ROPE for i in range(len(tables))]
    windows = [layer.self_attn.sliding_window for layer in ours.layers]
    assert windows == [
        4 if overrides.get("use_sliding_window") and i in nope else None
        for i in range(len(windows))
    ]

    def logits() -> torch.Tensor:
        ids, kv = SEQS["c"], PagedKV.for_model(ours)
        return torch.cat(
            [run(ours, kv, [("c", ids[:10])])] + [run(ours, kv, [("c", [t])]) for t in ids[10:]]
        )

    want = hf_logits(hf, SEQS["c"])
    torch.testing.assert_close(logits(), want, atol=ATOL, rtol=0)
    for layer in ours.layers:
        layer.self_attn.rope_table = ROPE
    assert (logits() - want).abs().max() > 100 * ATOL


def test_a_local_rope_table_is_read_by_every_layer_even_without_windows():
    """A model with a local RoPE table stacks both tables each step, so every layer picks a
    row: a sliding layer the local one, any other the global one, windows or not."""
    path = cached_tiny_model("olmo3")
    src = resolve_model(str(path))
    arch = load_arch(src)
    assert arch.rope_local_theta is not None
    for windows, tables in ((arch.sliding_windows, [1, 1, 1, 0]), ((), [0, 0, 0, 0])):
        local_arch = dataclasses.replace(arch, sliding_windows=windows)
        model = load_model(src, local_arch, torch.float32, "cpu")
        assert [layer.self_attn.rope_table for layer in model.layers] == tables
        kv = PagedKV.for_model(model)
        assert torch.isfinite(run(model, kv, [("c", SEQS["c"][:10])])).all()


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.25), (torch.float16, 0.05)])
def test_half_precision_runs_close_to_fp32(dtype, atol):
    path = cached_tiny_model("qwen2")
    src = resolve_model(str(path))
    model = load_model(src, load_arch(src), dtype, "cpu")
    assert model.embed_tokens.dtype == dtype
    ids, kv = SEQS["c"], PagedKV.for_model(model, dtype=dtype)
    logits = torch.cat(
        [run(model, kv, [("c", ids[:10])])] + [run(model, kv, [("c", [t])]) for t in ids[10:]]
    )
    assert logits.dtype == torch.float32
    _, hf = load_pair(path)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=atol, rtol=0)


def test_dense_and_packed_linear_backends_agree():
    ours, _ = load_pair(cached_tiny_model("llama"))
    ids = SEQS["c"]
    packed = run(ours, PagedKV.for_model(ours), [("c", ids)])
    apply_kernels(ours, KernelRequest(linear_backend="dense"))
    dense = run(ours, PagedKV.for_model(ours), [("c", ids)])
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="linear backend"):
        apply_kernels(ours, KernelRequest(linear_backend="fast"))


def test_registry_maps_names_and_rejects_unknown():
    for name in (
        "llama",
        "mistral",
        "qwen2",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
    ):
        assert get_model_class(name) is LlamaForCausalLM
    assert get_model_class("qwen3") is get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert get_model_class("smollm3") is get_model_class("SmolLM3ForCausalLM")
    assert get_model_class("granite") is get_model_class("GraniteForCausalLM")
    assert get_model_class("olmo2") is get_model_class("Olmo2ForCausalLM")
    assert get_model_class("olmo3") is get_model_class("Olmo3ForCausalLM")
    assert get_model_class("olmoe") is get_model_class("OlmoeForCausalLM")
    assert get_model_class("granitemoe") is get_model_class("GraniteMoeForCausalLM")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")
