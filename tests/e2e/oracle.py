"""HF transformers as the correctness oracle."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tokenbus import SamplingParams
from tokenbus.bench.hf_peer import load_hf_model

# Logprobs of an fp32 engine against HF's: equal up to summation order.
LOGPROB_ATOL = 2e-3


@functools.lru_cache(maxsize=4)
def load_hf(model_dir: str, gguf_file: str | None = None):
    """An HF model directory, or `gguf_file` inside `model_dir`, in fp32 (cached); a text model
    AutoModelForCausalLM does not map (Mistral 4's) by its own class."""
    from tests.fixtures.tiny_models import causal_lm_class

    config = Path(model_dir) / "config.json"
    if gguf_file is None and config.is_file():
        model_type = json.loads(config.read_text()).get("model_type")
        own = causal_lm_class(model_type)
        if own.__name__ != "AutoModelForCausalLM":
            return own.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_hf_model(str(Path(model_dir) / gguf_file) if gguf_file else model_dir, "float32")


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one unpadded prompt, EOS ignored (on the model's device)."""
    input_ids = torch.tensor([prompt_token_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt_token_ids) :].cpu().tolist()


def hf_greedy_logprobs(
    model, prompt_token_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """HF's greedy continuation and the logprob HF gives each of its tokens (one forward over
    the prompt and the continuation)."""
    tokens = hf_greedy(model, prompt_token_ids, max_new_tokens)
    with torch.inference_mode():
        ids = torch.tensor([prompt_token_ids + tokens], device=model.device)
        logits = model(ids).logits[0].float().cpu()
    rows = logits[len(prompt_token_ids) - 1 : -1].log_softmax(-1)  # the positions that chose them
    return tokens, rows[torch.arange(len(tokens)), tokens].tolist()


def greedy_outputs(llm, prompts: list[list[int]], max_tokens: int, logprobs: int = 1) -> list:
    """Each token-id prompt's greedy completion (CompletionOutput) of exactly `max_tokens`
    tokens, with the top `logprobs` logprobs at each position."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=logprobs
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0] for out in outputs]


def assert_matches_hf(outputs, reference, atol: float = LOGPROB_ATOL) -> None:
    """Our greedy completions carry HF's tokens, and the logprob HF gives each (reference:
    hf_greedy_logprobs per prompt) within `atol`."""
    for out, (tokens, logprobs) in zip(outputs, reference):
        assert out.token_ids == tokens
        ours = [position[token].logprob for position, token in zip(out.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=atol)


def assert_same_or_near_tie(got: list[int], want: list[int], logprobs, gap: float = 0.1) -> None:
    """Greedy tokens equal, or (different summation orders: oneDNN vs HF's matmuls, an
    all-reduce, quantized blocks) equal up to a first difference where `want`'s token is in our
    top-k (`logprobs` of our sequence) within `gap` nats of ours."""
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    position = logprobs[i]
    assert want[i] in position, (i, got, want)
    assert position[got[i]].logprob - position[want[i]].logprob < gap, (i, position)


def assert_smollm2_chat_matches_hf(llm, questions: list[str], max_tokens: int) -> None:
    """Greedy answers of `llm` (on the packaged SmolLM2 GGUF) to chat `questions` against HF
    transformers on the same GGUF, near ties allowed; then the leak check."""
    from tests.e2e.utils import assert_engine_clean
    from tokenbus import SamplingParams
    from tokenbus.loader import resolve_model

    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]
    source = resolve_model(None)
    hf = load_hf(str(source.path.parent), source.path.name)
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=5
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt in zip(outputs, prompts):
        assert_same_or_near_tie(
            out.outputs[0].token_ids, hf_greedy(hf, prompt, max_tokens), out.outputs[0].logprobs
        )
    assert_engine_clean(llm)


def assert_c_layers_match_dequantized(path, prompts: list[list[int]], max_tokens: int) -> None:
    """A quantized GGUF at `path` decodes every layer in one C call (blocks kept, fp32
    activations), with the tokens of the same file dequantized at load and run layer by layer,
    up to near ties."""
    assert_blocks_match_dequantized(path, prompts, max_tokens, in_c=True)


def assert_blocks_match_dequantized(
    path, prompts: list[list[int]], max_tokens: int, in_c: bool = False, **engine
) -> None:
    """A quantized GGUF at `path` run on its blocks (fp32 activations) gives the tokens of the
    same file dequantized at load, up to near ties; with `in_c`, its decode steps run every
    layer in one C call (and the dequantized file's do not)."""
    from tests.e2e.utils import assert_engine_clean, make_llm

    results = {}
    for quantization in ("gguf", "none"):
        llm = make_llm(
            path,
            quantization=quantization,
            quant_activations="fp32",
            kv_cache_dtype="float32",
            **engine,
        )
        model = llm.engine.client.engine_core.executor.worker.model
        assert (model.quant_kernels is not None) == (quantization == "gguf")
        if in_c:
            assert model.decodes_in_c == (quantization == "gguf")
        results[quantization] = greedy_outputs(llm, prompts, max_tokens, 5)
        assert_engine_clean(llm)
    for ours, dense in zip(results["gguf"], results["none"]):
        assert_same_or_near_tie(ours.token_ids, dense.token_ids, ours.logprobs)


def assert_ranks_match_hf(path, prompts, reference, max_tokens: int, ranks: int = 2) -> None:
    """The model at `path` on `ranks` tensor-parallel ranks, fp32, gives HF's greedy tokens
    (`reference`: hf_greedy_logprobs per prompt) up to near ties, and ends with every KV block
    free."""
    from tests.e2e.utils import assert_engine_clean, make_llm

    llm = make_llm(path, tensor_parallel_size=ranks, kv_cache_dtype="float32")
    try:
        outputs = greedy_outputs(llm, prompts, max_tokens, logprobs=5)
        for out, (tokens, _) in zip(outputs, reference, strict=True):
            assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def prompts_with_a_shared_prefix(seed: int, lengths: tuple[int, int] = (1, 50)) -> list[list[int]]:
    """Three prompts of `lengths` tokens, and three that share a 40-token prefix (two full
    blocks and 8 tokens: a batch's prefix-cache hits)."""
    from tests.e2e.utils import random_prompts

    prefix = random_prompts(1, 40, 40, seed=seed)[0]
    tails = random_prompts(3, 1, 20, seed + 2)
    return random_prompts(3, *lengths, seed=seed + 1) + [prefix + tail for tail in tails]


def family_fixtures(
    arch: str, prompt_seed: int, max_tokens: int, lengths: tuple[int, int] = (1, 50), **overrides
):
    """A family's three module-scoped fixtures: its tiny model (`hf_dir`: cached_tiny_model of
    `arch` with `overrides`), prompts_with_a_shared_prefix(prompt_seed, lengths) (`prompts`)
    and HF's greedy tokens and logprobs for them (`hf_reference`). A test module binds them:

        hf_dir, prompts, hf_reference = family_fixtures("arcee", 79, MAX_TOKENS)
    """
    from tests.fixtures.tiny_models import cached_tiny_model

    @pytest.fixture(scope="module", name="hf_dir")
    def hf_dir_fixture():
        return cached_tiny_model(arch, **overrides)

    @pytest.fixture(scope="module", name="prompts")
    def prompts_fixture():
        return prompts_with_a_shared_prefix(prompt_seed, lengths)

    @pytest.fixture(scope="module", name="hf_reference")
    def hf_reference_fixture(hf_dir, prompts):
        hf = load_hf(str(hf_dir))
        return [hf_greedy_logprobs(hf, prompt, max_tokens) for prompt in prompts]

    return hf_dir_fixture, prompts_fixture, hf_reference_fixture


def assert_family_matches_hf(path, prompts, reference, max_tokens: int, **engine) -> None:
    """The model at `path` (safetensors or GGUF), fp32 with prefix caching and 32-token chunks,
    gives HF's greedy tokens and logprobs (`reference`: hf_greedy_logprobs per prompt), hits the
    prefix cache, and ends with every KV block free."""
    from tests.e2e.utils import assert_engine_clean, make_llm

    llm = make_llm(
        path,
        enable_prefix_caching=True,
        max_num_batched_tokens=32,
        kv_cache_dtype="float32",
        **engine,
    )
    assert_matches_hf(greedy_outputs(llm, prompts, max_tokens, 1), reference)
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)
