"""GLM-4.5 (Glm4MoeForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
GLM-4.5 (q/k/v biases, per-head q/k norms, half of each head turning; the first layer's MLP
dense, then 8 experts, 2 a token, scored by their sigmoids, chosen by score + a random bias,
weighed x2.5, and a shared expert) from safetensors and from a GGUF in llama.cpp's glm4moe
naming gives HF's greedy tokens and logprobs through prefix-cache hits and 32-token chunks, on
both attention backends, and on two expert-parallel ranks; so does one whose router limits the
choice to the best 2 of 4 groups and does not renormalise. Its multi-token-prediction layer is
not read, and its Q8_0 file decodes every layer in C."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.e2e.utils import assert_engine_clean, make_llm
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model, with_an_mtp_layer

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32")
# The grouped router: 4 groups of 2 experts, the best 2 groups kept; no renormalising, no q/k norms
GROUPED = dict(n_group=4, topk_group=2, norm_topk_prob=False, use_qk_norm=False)


@pytest.fixture(scope="module", params=["released", "grouped"])
def hf_dir(request):
    return cached_tiny_model("glm4_moe", **(GROUPED if request.param == "grouped" else {}))


def grouped(hf_dir) -> bool:
    return load_hf(str(hf_dir)).config.n_group > 1


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(45)


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "glm4moe.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.num_hidden_layers, arch.dense_layers) == ("glm4_moe", 3, (0,))
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert (arch.rotary_dim, arch.shared_expert_intermediate_size) == (8, 32)
    assert (arch.moe_scoring, arch.moe_norm_eps, arch.routed_scaling_factor) == (
        "sigmoid",
        1e-20,
        2.5,
    )
    routing = (arch.moe_groups, arch.moe_topk_groups, arch.norm_topk_prob, arch.attn_qk_norm)
    assert routing == ((4, 2, False, False) if grouped(hf_dir) else (1, 1, True, True))
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_expert_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank routes every token and runs its 4 experts; rank 0 the shared one."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_the_multi_token_prediction_layer_is_not_read(hf_dir, prompts, hf_reference, tmp_path):
    """The released checkpoints carry an MTP layer after the model's (model.layers.L.*: a
    decoder layer with eh_proj, enorm, hnorm, shared_head.norm): left unread from safetensors,
    and from the GGUF the converter writes of it (block_count L + 1, nextn_predict_layers 1)."""
    from tokenbus.loader import iter_weights, load_arch, resolve_model

    if grouped(hf_dir):
        pytest.skip("the released shape only")
    model = with_an_mtp_layer(hf_dir, tmp_path / "mtp")
    gguf_path = write_gguf(model, tmp_path / "mtp.gguf")
    for path in (model, gguf_path):
        src = resolve_model(str(path))
        arch = load_arch(src)
        assert arch.num_hidden_layers == 3
        names = {name for name, _ in iter_weights(src, arch)}
        assert names and not any(name.startswith("model.layers.3.") for name in names)
    llm = make_llm(model, **ENGINE)
    outputs = greedy_outputs(llm, prompts, MAX_TOKENS)
    assert [out.token_ids for out in outputs] == [tokens for tokens, _ in hf_reference]
    assert_engine_clean(llm)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept (each expert's rows of the stacked tensors too): every decode step in
    one C call, routing included, with the dequantized file's tokens up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "glm4moe-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_solar_open_is_glm_4_5s_moe_under_llamas_attention(kind, tmp_path):
    """Solar Open (SolarOpenForCausalLM): GLM-4.5's MoE in every layer, attention without
    biases or q/k norms turning the whole head; llama.cpp writes it as glm4moe."""
    from tokenbus.loader import load_arch, resolve_model

    hf_dir = cached_tiny_model("solar_open")
    prompts = prompts_with_a_shared_prefix(47)
    hf = load_hf(str(hf_dir))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "solar.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert arch.architecture == ("solar_open" if kind == "safetensors" else "glm4_moe")
    assert (arch.dense_layers, arch.rotary_dim, arch.attn_qk_norm, arch.attention_bias) == (
        (),
        None,
        False,
        False,
    )
    assert (arch.moe_scoring, arch.shared_expert_intermediate_size) == ("sigmoid", 32)
    assert_family_matches_hf(path, prompts, reference, MAX_TOKENS)
