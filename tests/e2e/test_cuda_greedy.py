"""Greedy tokens on a GPU against HF transformers (tiny random Llama and Qwen2 models, and in
fp32 a DeepSeek-V3, a Gemma 3n and a Gemma 4): exact in fp32; in bf16 equal up to a first near
tie. Skipped without a GPU (benchmarks/gpu_check.sh runs them where there is one), with the default
CUDA attention backend (Triton) and CUDA graphs."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.e2e.oracle import assert_same_or_near_tie, hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 16
ENGINE = dict(device="cuda", max_num_seqs=16, max_model_len=256, kv_cache_memory="256MiB")


# DeepSeek-V3's: latent attention (one KV head of 40, 4 query heads over it) and grouped
# sigmoid routing, through Triton attention and Triton MoE; Gemma 3n's: sliding windows, the
# last layers attending earlier layers' K/V, AltUp, captured in CUDA graphs; Gemma 4's: layers
# of two head sizes and KV head counts in one step's plan and graphs
@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3", "gemma3n", "gemma4"])
def test_fp32_greedy_equals_hf(arch):
    import transformers

    if arch == "gemma4" and not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    path = cached_tiny_model(arch)
    prompts = random_prompts(12, 1, 90, seed=2)
    hf = load_hf(str(path))
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, dtype="float32", **ENGINE)
    assert llm.engine.config.model.attention_backend == "triton"
    assert generate_greedy(llm, prompts, MAX_TOKENS) == expected
    assert_engine_clean(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_greedy_equals_hf_up_to_near_ties(arch):
    path = cached_tiny_model(arch)
    prompts = random_prompts(12, 1, 90, seed=3)
    hf = copy.deepcopy(load_hf(str(path))).to("cuda", torch.bfloat16)  # the cache stays fp32
    llm = make_llm(path, dtype="bfloat16", **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        want = hf_greedy(hf, prompt, MAX_TOKENS)
        got = output.outputs[0]
        assert_same_or_near_tie(list(got.token_ids), want, got.logprobs, gap=0.25)
    assert_engine_clean(llm)
