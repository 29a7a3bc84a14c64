"""Sliding-window attention end to end against HF transformers, fp32 on CPU: a tiny Mistral with
sliding_window=16 on prompts of 60+ tokens (every query past the 16th sees only its last 16 keys)
gives HF's greedy tokens, with logprobs within tolerance, on the torch path and on the native
kernel (its decode path, its short-query path and its flash path for long chunks), through
whole prefills, small chunks and decodes; and a Qwen2 whose upper layers alone are windowed
(use_sliding_window + max_window_layers) likewise, and a Ministral whose layer_types
alternate windowed and full layers."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.oracle import assert_matches_hf, greedy_outputs, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
WINDOW = 16
ENGINE = dict(kv_cache_dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def mistral_dir():
    return cached_tiny_model("mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2_dir():
    return cached_tiny_model(
        "qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 60, 90, seed=31)


def hf_reference(model_dir, prompts):
    """HF's greedy tokens and the logprob HF gives each of them, per prompt."""
    hf = load_hf(str(model_dir))
    result = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):  # plain greedy over the whole sequence each step
                logits = hf(torch.tensor([ids])).logits[0, -1].float()
                ids.append(int(logits.argmax()))
            tokens = ids[len(prompt) :]
            logits = hf(torch.tensor([ids])).logits[0].float()
        rows = logits[len(prompt) - 1 : -1].log_softmax(-1)
        result.append((tokens, rows[torch.arange(len(tokens)), tokens].tolist()))
    return result


@pytest.fixture(scope="module")
def mistral_reference(mistral_dir, prompts):
    return hf_reference(mistral_dir, prompts)


def generate(llm, prompts, logprobs=1):
    return greedy_outputs(llm, prompts, MAX_TOKENS, logprobs)


def test_window_is_read_from_the_config(mistral_dir, qwen2_dir):
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(mistral_dir)))
    assert arch.sliding_windows == (WINDOW, WINDOW)
    assert arch.max_position_embeddings == 512  # no longer capped at the window
    arch = load_arch(resolve_model(str(qwen2_dir)))
    assert arch.sliding_windows == (None, WINDOW, WINDOW)


def test_hf_oracle_differs_from_full_attention(mistral_dir, prompts, mistral_reference):
    """The window matters for these prompts: without it HF picks other tokens."""
    full = cached_tiny_model("mistral", sliding_window=None)
    assert [t for t, _ in hf_reference(full, prompts)] != [t for t, _ in mistral_reference]


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("chunk", [None, 16, 5])
def test_mistral_window_matches_hf(mistral_dir, prompts, mistral_reference, backend, chunk):
    """chunk None: whole prefills (the flash path on native); 16 / 5: chunks of at most that
    many tokens (the kernel's short-query path, each chunk's queries at other window starts)."""
    budget = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=3)
    llm = make_llm(mistral_dir, attention_backend=backend, **budget, **ENGINE)
    assert (
        llm.engine.client.engine_core.executor.worker.model.layers[0].self_attn.sliding_window
        == WINDOW
    )
    assert_matches_hf(generate(llm, prompts), mistral_reference)
    assert_engine_clean(llm)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_qwen2_mixing_window_and_full_layers(qwen2_dir, prompts, backend):
    llm = make_llm(qwen2_dir, attention_backend=backend, max_num_batched_tokens=32, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference(qwen2_dir, prompts))
    assert_engine_clean(llm)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"] * 2])
def test_ministral_windows_by_layer_types(prompts, layer_types):
    """Ministral (8B-2410): Mistral whose windowed layers its layer_types name (all of them
    without)."""
    from tokenbus.loader import load_arch, resolve_model

    model_dir = cached_tiny_model(
        "ministral",
        num_hidden_layers=4,
        head_dim=16,  # MinistralConfig leaves it None, which its attention cannot take
        sliding_window=WINDOW,
        layer_types=layer_types,
    )
    arch = load_arch(resolve_model(str(model_dir)))
    want = (WINDOW,) * 4 if layer_types is None else (WINDOW, None, WINDOW, None)
    assert (arch.architecture, arch.sliding_windows) == ("ministral", want)
    llm = make_llm(model_dir, max_num_batched_tokens=32, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference(model_dir, prompts))
    assert_engine_clean(llm)
