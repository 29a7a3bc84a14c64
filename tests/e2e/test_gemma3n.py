"""Gemma 3n (Gemma3nForCausalLM, the text model of Gemma3nForConditionalGeneration) end to end
against HF transformers, fp32 on CPU: a tiny random model with its four AltUp streams, per-layer
inputs (a table of the first 40000 ids: the tokenizer's others read row 0), LAuReL, sparse MLP
gates on its first two layers, local and global layers with their own RoPE bases, and its last
two layers attending layers 3's and 2's K/V, gives HF's greedy tokens and logprobs from
safetensors and from a GGUF in llama.cpp's gemma3n naming (AltUp projections stacked, the
per-layer table padded), through prefix-cache hits and 32-token chunks, on both attention
backends, on two tensor-parallel ranks, on Q8_0 blocks (the per-layer table too), and as an
image-and-audio checkpoint's text model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tests.fixtures.triton_device import DEVICE, needs_triton

MAX_TOKENS = 10
# A GGUF's per-layer table is padded to the vocabulary with zero rows (llama.cpp's converter),
# which ids past HF's table then read: its test model's table covers the whole vocabulary.
WHOLE_TABLE = dict(vocab_size_per_layer_input=49152)


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(48)


def _reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def hf_reference(prompts):
    return _reference(cached_tiny_model("gemma3n"), prompts)


@pytest.fixture(scope="module")
def whole_table_reference(prompts):
    return _reference(cached_tiny_model("gemma3n", **WHOLE_TABLE), prompts)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_safetensors_give_hf_s_tokens_and_logprobs(prompts, hf_reference, backend):
    from tokenbus.loader import load_arch, resolve_model

    path = cached_tiny_model("gemma3n")
    arch = load_arch(resolve_model(str(path)))
    assert arch.architecture == "gemma3n" and arch.num_kv_layers == 4
    assert arch.kv_shared_layers == ((4, 3), (5, 2))
    assert arch.sliding_windows == (32, 32, None, 32, 32, None)
    assert (arch.rope_theta, arch.rope_local_theta) == (1_000_000.0, 10000.0)
    assert (arch.per_layer_input_size, arch.per_layer_vocab_size) == (16, 40000)
    assert (arch.altup_inputs, arch.laurel_rank, arch.final_logit_softcapping) == (4, 8, 5.0)
    assert arch.activation_sparsity_std[:3] == (pytest.approx(1.6448536),) * 2 + (None,)
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_gguf_gives_hf_s_tokens_and_logprobs(prompts, whole_table_reference, backend, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = write_gguf(cached_tiny_model("gemma3n", **WHOLE_TABLE), tmp_path / "gemma3n.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert arch.kv_shared_layers == ((4, 3), (5, 2)) and arch.per_layer_vocab_size == 49152
    assert arch.activation_sparsity_std[2:] == (None,) * 4  # llama.cpp's -inf: no sparsity
    assert_family_matches_hf(
        path, prompts, whole_table_reference, MAX_TOKENS, attention_backend=backend
    )


@needs_triton
def test_triton_attention_gives_hf_s_tokens(prompts, hf_reference):
    """The Triton kernels (on CPU in their interpreter): the readers' K/V, their owners' of
    the step, written again into the owners' slots and read in place, windows included."""
    from tests.e2e.oracle import assert_matches_hf, greedy_outputs
    from tests.e2e.utils import assert_engine_clean, make_llm

    llm = make_llm(
        cached_tiny_model("gemma3n"),
        attention_backend="triton",
        device=DEVICE,
        dtype="float32",
        kv_cache_dtype="float32",
        max_num_batched_tokens=32,
    )
    assert_matches_hf(greedy_outputs(llm, prompts[:4], MAX_TOKENS, 1), hf_reference[:4])
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(prompts, hf_reference):
    """Each rank holds two of the four query heads, one KV head, and half of each MLP: the
    sparse gates' mean and deviation are summed over both halves."""
    assert_ranks_match_hf(cached_tiny_model("gemma3n"), prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_q8_0_blocks_match_the_dequantized_file(prompts, tmp_path):
    """Q8_0 wherever rows are whole blocks (the per-layer table, read row by row, too); F32
    elsewhere, as llama.cpp falls back."""
    from gguf import GGUFReader

    def qtype(name: str) -> str:
        return "F32" if name.startswith(_NARROW) else "Q8_0"

    hf_dir = cached_tiny_model("gemma3n", **WHOLE_TABLE)
    path = write_gguf(hf_dir, tmp_path / "gemma3n-q8_0.gguf", qtype)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["per_layer_token_embd.weight"] == "Q8_0" == types["blk.5.attn_q.weight"]
    assert_blocks_match_dequantized(path, prompts[:4], MAX_TOKENS)


# tensors whose rows are not whole Q8_0 blocks in the tiny model (16, 8 or 4 values)
_NARROW = tuple(f"blk.{i}.{name}" for i in range(6) for name in ("proj.", "laurel_r.", "altup_"))


def test_image_and_audio_checkpoint_serves_its_text_model(prompts, hf_reference, tmp_path):
    """Gemma3nForConditionalGeneration's file: a sparse text_config (the text config class's
    defaults fill it) and the text weights under model.language_model, beside towers that are
    left unread."""
    from safetensors.torch import load_file, save_file

    hf_dir = cached_tiny_model("gemma3n")
    out = tmp_path / "gemma3n-it"
    shutil.copytree(hf_dir, out)
    text = json.loads((hf_dir / "config.json").read_text())
    text = {key: text[key] for key in _RELEASED_TEXT_KEYS}
    config = {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "text_config": text,
        "vision_config": {"model_type": "gemma3n_vision"},
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = {
        f"model.language_model.{name.removeprefix('model.')}": tensor
        for name, tensor in load_file(str(hf_dir / "model.safetensors")).items()
    }
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.zeros(4, 3, 3, 3)
    weights["model.embed_audio.embedding.weight"] = torch.zeros(8, 16)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert_family_matches_hf(out, prompts, hf_reference, MAX_TOKENS)


# what a released text_config spells out (the rest: Gemma3nTextConfig's defaults)
_RELEASED_TEXT_KEYS = (
    *("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"),
    *("num_attention_heads", "num_key_value_heads", "head_dim", "layer_types"),
    *("sliding_window", "num_kv_shared_layers", "activation_sparsity_pattern"),
    *("vocab_size_per_layer_input", "hidden_size_per_layer_input", "laurel_rank"),
    *("final_logit_softcapping", "rms_norm_eps", "rope_parameters", "tie_word_embeddings"),
    *("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"),
)
