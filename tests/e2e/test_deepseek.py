"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM), GLM-4.7-Flash
(Glm4MoeLiteForCausalLM) and Mistral Small 4 (Mistral4ForCausalLM) end to end against HF
transformers, fp32 on CPU: tiny random models with multi-head latent attention (V2-Lite's shape
under YaRN without a query bottleneck; the others' with one), a dense first layer, then experts
routed by softmax (V2; Mistral 4's within the best 2 of 4 groups) or by sigmoid score + a bias
(V3: within the best 2 of 4 groups), and a shared MLP; Mistral 4's queries scaled by Llama 4's
temperature past every 16th position. From safetensors and from
GGUFs written as llama.cpp's deepseek2 converter writes them (kv_b_proj split in two), they give
HF's greedy tokens and logprobs through prefix-cache hits and 32-token chunks, on both attention
backends, on two tensor-parallel ranks, and on Q8_0 blocks with every decode step in C; the
cache holds one latent a token, and the multi-token-prediction layers are not read."""

from __future__ import annotations

import json

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
FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4")
# (scoring, renormalised, routed scale, groups, kept groups, query bottleneck) per family
ROUTERS = {
    "deepseek_v2": ("softmax", False, 1.5, 1, 1, 0),
    "deepseek_v3": ("sigmoid", True, 2.5, 4, 2, 32),
    "glm4_moe_lite": ("sigmoid", True, 1.8, 1, 1, 32),
    "mistral4": ("softmax", True, 1.5, 4, 2, 32),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_dir(family):
    return cached_tiny_model(family)


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(46)


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    family, hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "deepseek2.gguf")
    arch = load_arch(resolve_model(str(path)))
    # llama.cpp writes GLM-4.7-Flash as deepseek2 with V3's router
    name = "deepseek_v3" if kind == "gguf" and family == "glm4_moe_lite" else family
    assert (arch.architecture, arch.num_hidden_layers, arch.dense_layers) == (name, 3, (0,))
    # the cache's one KV head: the latent (32) and the turned key (8)
    assert (arch.num_key_value_heads, arch.head_dim, arch.rotary_dim) == (1, 40, 8)
    assert (arch.kv_lora_rank, arch.qk_nope_head_dim, arch.v_head_dim) == (32, 16, 16)
    assert arch.kv_bytes_per_token == 2 * 3 * 40
    scoring, norm, scale, groups, kept, q_lora_rank = ROUTERS[family]
    assert (arch.moe_scoring, arch.norm_topk_prob, arch.moe_groups, arch.moe_topk_groups) == (
        scoring,
        norm,
        groups,
        kept,
    )
    assert arch.routed_scaling_factor == pytest.approx(scale)
    assert (arch.q_lora_rank, arch.moe_selection_bias) == (q_lora_rank, scoring == "sigmoid")
    mscale = {"deepseek_v2": pytest.approx(0.707), "mistral4": pytest.approx(1.0)}.get(family)
    assert (arch.rope_scaling or {}).get("mscale_all_dim") == mscale
    # Mistral 4's query temperature: beta 0.1 over the YaRN's original context (a GGUF's keys)
    temperature = (pytest.approx(0.1), 16) if family == "mistral4" else None
    assert arch.attn_temperature == temperature
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank holds half the query heads (their rows of q_b_proj / q_proj and kv_b_proj,
    their columns of o_proj) over the latent, whole on both, and half the experts."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept: every decode step in one C call, the latent attention (its absorbed
    products on W_UK and W_UV, the one KV head of the cache) included, with the dequantized
    file's tokens (run layer by layer) up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "deepseek2-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts[:4], MAX_TOKENS)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite"])
def test_the_multi_token_prediction_layer_is_not_read(name, prompts, tmp_path):
    """DeepSeek-V3's and GLM-4.7-Flash's checkpoints carry an MTP layer after the model's
    (model.layers.L.*): left unread, as transformers leaves it; from GLM-4.7-Flash's GGUF too,
    whose converter counts it in block_count and says so in nextn_predict_layers."""
    from tokenbus.loader import iter_weights, load_arch, resolve_model

    hf_dir = cached_tiny_model(name)
    hf = load_hf(str(hf_dir))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS)[0] for prompt in prompts[:4]]
    model = with_an_mtp_layer(hf_dir, tmp_path / "mtp")
    paths = [model]
    if name == "glm4_moe_lite":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
        paths.append(write_gguf(model, tmp_path / "mtp.gguf"))
    for path in paths:
        src = resolve_model(str(path))
        arch = load_arch(src)
        names = {name for name, _ in iter_weights(src, arch)}
        assert arch.num_hidden_layers == 3 and names
        assert not any(name.startswith("model.layers.3.") for name in names)
        llm = make_llm(path, **ENGINE)
        outputs = greedy_outputs(llm, prompts[:4], MAX_TOKENS)
        assert [out.token_ids for out in outputs] == reference
        assert_engine_clean(llm)


def test_unsupported_routing_is_refused_by_name(tmp_path):
    """DeepSeek-V2's group_limited_greedy (each group scored by its best expert) is refused."""
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("deepseek_v2"), tmp_path / "grouped")
    config = json.loads((model / "config.json").read_text())
    config.update(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="topk_method 'group_limited_greedy'"):
        load_arch(resolve_model(str(model)))
