"""The CPU's captured decode step: each decoder layer in one C call (model/native/decode_layer.c)
against --enforce-eager (every layer op by op), through whole engines on a tiny Q4_1 GGUF:
identical greedy tokens at every batch size with prefill chunks, structured output and ngram
spec decode; explicit capture sizes do not compile over it."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, model_runner
from tests.fixtures.mode_equality import (
    ENGINE,
    NGRAM,
    json_batch,
    ngram_prompts,
    staggered_batch,
    token_ids,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.utils.cpu import CpuFeatures

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not CpuFeatures.detect().has("avx2", "fma"),
    reason="the C decode layer runs tiled GGUF kernels: a C compiler and AVX2 + FMA needed",
)


def model_of(llm):
    return llm.engine.client.engine_core.executor.worker.model


def count_c_steps(llm) -> list[tuple[int, int]]:
    """Wrap the model's C layers: (tokens, requests) of every step that ran them (all layers in
    one call: no connector here)."""
    layers = model_of(llm).kernels.decode_layers
    steps: list[tuple[int, int]] = []
    run_all = layers.run_all

    def counting(num_layers, step, *args):
        steps.append((step.num_tokens, step.num_reqs))
        return run_all(num_layers, step, *args)

    layers.run_all = counting
    return steps


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def in_c(gguf_path):
    llm = make_llm(gguf_path, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def eager(gguf_path):
    llm = make_llm(gguf_path, enforce_eager=True, **ENGINE)
    yield llm
    llm.shutdown()


def test_default_engine_decodes_in_c_and_enforce_eager_does_not(in_c, eager):
    assert model_of(in_c).decodes_in_c and not model_of(eager).decodes_in_c


def test_greedy_tokens_equal_eager_at_every_batch_size_with_prefill_chunks(in_c, eager):
    """Staggered lengths: the decode batch shrinks 4 -> 1, and long prompts prefill in 64-token
    chunks next to decodes (a step of up to 64 tokens on the native attention runs in C too)."""
    requests, params = staggered_batch()
    steps = count_c_steps(in_c)
    assert token_ids(in_c, requests, params) == token_ids(eager, requests, params)
    assert {(n, n) for n in (1, 2, 3, 4)} <= set(steps)  # every decode batch size ran in C
    assert_engine_clean(in_c)


def test_structured_output_equal_eager(in_c, eager):
    requests, params = json_batch()
    assert token_ids(in_c, requests, params) == token_ids(eager, requests, params)


def test_ngram_spec_decode_equal_eager(gguf_path):
    """Verification steps (several tokens a request) run in C as well: same tokens."""
    prompts = ngram_prompts()
    ref_llm = make_llm(gguf_path, speculative_config=NGRAM, enforce_eager=True, **ENGINE)
    ref = generate_greedy(ref_llm, prompts, 16)
    ref_llm.shutdown()
    spec = make_llm(gguf_path, speculative_config=NGRAM, **ENGINE)
    try:
        steps = count_c_steps(spec)
        with spec.engine.measure_spec_decode() as metrics:
            assert generate_greedy(spec, prompts, 16) == ref
        assert metrics.num_drafts > 0
        # After the prompts' step, a step of more tokens than requests verifies drafts, in C.
        assert any(tokens > reqs for tokens, reqs in steps[1:])
    finally:
        spec.shutdown()


def test_explicit_capture_sizes_do_not_compile_over_the_c_layers(gguf_path, caplog):
    """On CPU nothing is captured (the C layers are the fast decode step): listing sizes logs
    why they have no effect."""
    with caplog.at_level("INFO", logger="tokenbus.worker.captured_step"):
        llm = make_llm(gguf_path, cudagraph_capture_sizes=[1, 2], **ENGINE)
    try:
        assert model_runner(llm).captured is None
        assert model_of(llm).decodes_in_c
        assert any("one C call" in r.getMessage() for r in caplog.records)
    finally:
        llm.shutdown()


def assert_in_c_like_eager(path, check, **kwargs) -> None:
    """The staggered batch's greedy tokens through the C layers equal --enforce-eager's, with
    every decode batch size in C and the engine clean after; `check(llm)` looks at the C
    engine first."""
    requests, params = staggered_batch()
    eager = make_llm(path, enforce_eager=True, **kwargs, **ENGINE)
    try:
        want = token_ids(eager, requests, params)
    finally:
        eager.shutdown()
    llm = make_llm(path, **kwargs, **ENGINE)
    try:
        check(llm)
        steps = count_c_steps(llm)
        assert token_ids(llm, requests, params) == want
        assert {(n, n) for n in (1, 2, 3, 4)} <= set(steps)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_gemma3_with_hybrid_kv_groups_decodes_in_c_like_eager(tmp_path):
    """Gemma 3's local layers (window 32) read their own KV group's block tables, which drop the
    blocks that fell out of the window: the C layers take each layer's group and rotary table,
    and greedy tokens equal --enforce-eager's through prompts well past the window."""
    hf = cached_tiny_model("gemma3", hidden_size=256, intermediate_size=512)
    path = write_gguf(hf, tmp_path / "gemma3-q8_0.gguf", "Q8_0")

    def check(llm) -> None:
        # groups of equal size (core/kv/hybrid.plan_kv_groups): one of each layer here
        assert sorted(model_runner(llm).buffers.layer_groups) == list(range(6))

    assert_in_c_like_eager(path, check)


def test_gemma4_layers_of_two_shapes_decode_in_c_like_eager(tmp_path):
    """Gemma 4's local layers (window 32, KV heads of 16) and global ones (one KV head of 32,
    values as keys) in KV groups of their own shapes, the last two layers reading layers 3's and
    2's K/V, per-layer inputs: in C through prompts past the window, as --enforce-eager."""
    hf = cached_tiny_model(
        "gemma4", hidden_size=256, intermediate_size=512, hidden_size_per_layer_input=32
    )
    path = write_gguf(hf, tmp_path / "gemma4-q8_0.gguf", "Q8_0")

    def check(llm) -> None:
        layers = model_of(llm).kernels.decode_layers
        assert layers is not None and layers.per_layer_width == 32
        groups = model_runner(llm).buffers.layer_groups
        assert groups[4] == groups[3] and groups[5] == groups[2] and groups[2] != groups[0]

    assert_in_c_like_eager(path, check)


def test_smollm3_nope_layers_decode_in_c_like_eager(tmp_path):
    """SmolLM3's NoPE layer (the last of four) reads the identity rotary table in C as well."""
    hf = cached_tiny_model("smollm3", hidden_size=256, intermediate_size=512)
    path = write_gguf(hf, tmp_path / "smollm3-q8_0.gguf", "Q8_0")

    def check(llm) -> None:
        model = model_of(llm)
        assert [layer.self_attn.rope_table for layer in model.layers] == [0, 0, 0, 1]
        assert model.kernels.decode_layers.num_rope_tables == 2

    assert_in_c_like_eager(path, check)


def test_granite_residual_scale_decodes_in_c_like_eager(tmp_path):
    """Granite's residual_multiplier scales each sublayer's output in C as in torch (here a
    large one, with unscaled embeddings: the layers then steer the tokens)."""
    hf = cached_tiny_model(
        "granite",
        hidden_size=256,
        intermediate_size=512,
        embedding_multiplier=1.0,
        residual_multiplier=2.5,
    )
    path = write_gguf(hf, tmp_path / "granite-q8_0.gguf", "Q8_0")

    def check(llm) -> None:
        assert [layer.residual_scale for layer in model_of(llm).layers] == [2.5] * 2

    assert_in_c_like_eager(path, check)


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_olmo_post_norm_layers_decode_in_c_like_eager(tmp_path, family):
    """OLMo 2's layers (no norm before either sublayer, q and k normed over each token's whole
    projection) run in C as op by op; OLMo 3's local layers with their window, KV group and
    unscaled rotary table too."""
    hf = cached_tiny_model(family, hidden_size=256, intermediate_size=512)
    path = write_gguf(hf, tmp_path / f"{family}-q8_0.gguf", "Q8_0")

    def check(llm) -> None:
        model = model_of(llm)
        assert model.decodes_in_c
        for layer in model.layers:
            assert layer.input_layernorm is None and layer.pre_feedforward_layernorm is None
            assert layer.self_attn.q_norm.weight.shape == (256,)  # 4 heads of 64
        if family == "olmo3":
            assert model.kernels.decode_layers.num_rope_tables == 2

    assert_in_c_like_eager(path, check)


def test_safetensors_model_rounded_to_q8_0_decodes_in_c_like_eager():
    """--quantization q8_0 on a safetensors model: its linears (and embedding) on Q8_0 tiles,
    decode steps in C, the same greedy tokens as op by op."""
    path = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)

    def check(llm) -> None:
        assert llm.engine.config.model.quantization == "q8_0"
        assert model_of(llm).decodes_in_c and model_of(llm).embed_quantized is not None

    assert_in_c_like_eager(path, check, quantization="q8_0")
