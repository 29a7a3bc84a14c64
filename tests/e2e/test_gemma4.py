"""Gemma 4 (Gemma4ForCausalLM, the text model of Gemma4ForConditionalGeneration) end to end
against HF transformers, fp32 on CPU: a tiny random model with local layers of 2 KV heads of 16
and global ones of 1 KV head of 32 whose values are their keys, the global layers' proportional
rope, per-layer inputs, trained layer scalars, and its last two layers attending layers 3's and
2's K/V with MLPs twice as wide, gives HF's greedy tokens and logprobs from safetensors and from
a GGUF in llama.cpp's gemma4 naming, through prefix-cache hits and 32-token chunks, on both
attention backends, with and without the hybrid KV cache, on two tensor-parallel ranks, on Q8_0
blocks, as an image-and-text checkpoint's text model, as the 31B's kind (no per-layer inputs,
no shared K/V) and as the 26B-A4B's (experts beside every MLP)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tests.fixtures.triton_device import DEVICE, needs_triton

MAX_TOKENS = 10
SHAPES = ((2, 16), (2, 16), (1, 32), (2, 16), (2, 16), (1, 32))  # (KV heads, head size)
# the 31B's kind: every layer its own K/V, no per-layer inputs
DENSE = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
# the 26B-A4B's kind: the 31B's with 4 experts of 32 (2 a token) beside every layer's MLP
MOE = dict(DENSE, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)

hf_dir, prompts, hf_reference = family_fixtures("gemma4", prompt_seed=48, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_safetensors_give_hf_s_tokens_and_logprobs(hf_dir, prompts, hf_reference, backend):
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(hf_dir)))
    assert arch.architecture == "gemma4" and arch.layer_kv_shapes == SHAPES
    assert arch.kv_shared_layers == ((4, 3), (5, 2)) and arch.attn_k_eq_v
    assert arch.layer_intermediate_sizes == (128,) * 4 + (256,) * 2
    assert arch.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (arch.rope_theta, arch.rope_local_theta) == (1_000_000.0, 10000.0)
    assert (arch.head_dim, arch.global_head_dim, arch.per_layer_input_size) == (16, 32, 16)
    assert_family_matches_hf(hf_dir, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_gguf_gives_hf_s_tokens_and_logprobs(hf_dir, prompts, hf_reference, backend, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = write_gguf(hf_dir, tmp_path / "gemma4.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert arch.layer_kv_shapes == SHAPES and arch.attn_k_eq_v
    assert arch.kv_shared_layers == ((4, 3), (5, 2)) and arch.per_layer_vocab_size == 49152
    assert arch.rope_scaling["rope_type"] == "freq_factors"  # llama.cpp's rope_freqs
    assert arch.rope_scaling["factors"][:4] == (1.0,) * 4 and arch.rope_scaling["factors"][4] > 1e29
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_without_the_hybrid_kv_cache(hf_dir, prompts, hf_reference):
    """Every layer its own pool, in its own shape, for the whole context."""
    assert_family_matches_hf(
        hf_dir, prompts, hf_reference, MAX_TOKENS, disable_hybrid_kv_cache_manager=True
    )


@needs_triton
def test_triton_attention_gives_hf_s_tokens(hf_dir, prompts, hf_reference):
    """The Triton kernels (on CPU in their interpreter) at both head sizes."""
    from tests.e2e.oracle import assert_matches_hf, greedy_outputs
    from tests.e2e.utils import assert_engine_clean, make_llm

    llm = make_llm(
        hf_dir,
        attention_backend="triton",
        device=DEVICE,
        dtype="float32",
        kv_cache_dtype="float32",
        max_num_batched_tokens=32,
    )
    assert_matches_hf(greedy_outputs(llm, prompts[:4], MAX_TOKENS, 1), hf_reference[:4])
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank holds two of the four query heads of either size, one local KV head, the
    global layers' one KV head (both ranks), and half of each MLP."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_q8_0_blocks_match_the_dequantized_file(hf_dir, prompts, tmp_path):
    """Q8_0 wherever rows are whole blocks (the per-layer table, read row by row, too); F32
    elsewhere (the per-layer projections' rows of 16), as llama.cpp falls back."""
    from gguf import GGUFReader

    def qtype(name: str) -> str:
        return "F32" if ".proj." in name or name == "rope_freqs.weight" else "Q8_0"

    path = write_gguf(hf_dir, tmp_path / "gemma4-q8_0.gguf", qtype)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["per_layer_token_embd.weight"] == "Q8_0" == types["blk.2.attn_q.weight"]
    assert_blocks_match_dequantized(path, prompts[:4], MAX_TOKENS)


def test_image_and_text_checkpoint_serves_its_text_model(hf_dir, prompts, hf_reference, tmp_path):
    """Gemma4ForConditionalGeneration's file: a sparse text_config naming the global layers'
    shape by global_head_dim and num_global_key_value_heads (the text config class fills the
    rest), the text weights under model.language_model beside a tower left unread."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "gemma4-it"
    shutil.copytree(hf_dir, out)
    full = json.loads((hf_dir / "config.json").read_text())
    text = {key: full[key] for key in _SPARSE_TEXT_KEYS}
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {"model_type": "gemma4_vision"},
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = {
        f"model.language_model.{name.removeprefix('model.')}": tensor
        for name, tensor in load_file(str(hf_dir / "model.safetensors")).items()
    }
    weights["model.vision_tower.patch_embedder.input_proj.weight"] = torch.zeros(4, 3)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert_family_matches_hf(out, prompts, hf_reference, MAX_TOKENS)


_SPARSE_TEXT_KEYS = (
    *("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"),
    *("num_attention_heads", "num_key_value_heads", "head_dim", "layer_types"),
    *("sliding_window", "num_kv_shared_layers", "attention_k_eq_v", "use_double_wide_mlp"),
    *("vocab_size_per_layer_input", "hidden_size_per_layer_input", "final_logit_softcapping"),
    *("rms_norm_eps", "rope_parameters", "tie_word_embeddings", "max_position_embeddings"),
    *("bos_token_id", "eos_token_id", "pad_token_id"),
)


def test_the_31b_kind_without_per_layer_inputs(prompts):
    """Every layer holds its own K/V and takes no per-layer input (the 31B's shape)."""
    from tests.e2e.oracle import hf_greedy_logprobs, load_hf
    from tokenbus.loader import load_arch, resolve_model

    path = cached_tiny_model("gemma4", **DENSE)
    arch = load_arch(resolve_model(str(path)))
    assert arch.per_layer_input_size == 0 and arch.kv_shared_layers == ()
    assert arch.layer_intermediate_sizes == () and arch.num_kv_layers == 6
    hf = load_hf(str(path))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]
    assert_family_matches_hf(path, prompts, reference, MAX_TOKENS)


@pytest.fixture(scope="module")
def moe_reference(prompts):
    from tests.e2e.oracle import hf_greedy_logprobs, load_hf

    hf = load_hf(str(cached_tiny_model("gemma4", **MOE)))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_the_26b_a4b_kind_with_experts_beside_the_mlp(prompts, moe_reference, source, tmp_path):
    """Tanh-GELU experts beside each layer's MLP, routed from the residual stream (normed,
    scaled per channel, softmax, top 2 renormalised, each weight by its expert's scale); from a
    GGUF with the experts' gate and up fused (ffn_gate_up_exps) and the router's scales as
    llama.cpp's .scale tensors."""
    from tokenbus.loader import load_arch, resolve_model

    path = cached_tiny_model("gemma4", **MOE)
    if source == "gguf":
        path = write_gguf(path, tmp_path / "gemma4-moe.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (4, 2, 32)
    backend = "native" if source == "gguf" else "torch"
    assert_family_matches_hf(path, prompts, moe_reference, MAX_TOKENS, attention_backend=backend)


def test_experts_on_two_ranks(prompts, moe_reference):
    """Expert parallel: each rank two whole experts, the router whole on both."""
    path = cached_tiny_model("gemma4", **MOE)
    assert_ranks_match_hf(path, prompts[:4], moe_reference[:4], MAX_TOKENS)


def test_q8_0_experts_match_the_dequantized_file(prompts, tmp_path):
    """The experts kept in Q8_0 blocks (gate and up fused), run by the quantized kernels."""
    path = write_gguf(cached_tiny_model("gemma4", **MOE), tmp_path / "moe-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts[:4], MAX_TOKENS)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one group"])
def test_global_heads_wider_than_the_flash_path_takes(prompts, hybrid):
    """Global heads of 512 (the config class's default), past the native flash path's 256.
    Under the hybrid cache each KV group plans for its own layers' shape: the global layers'
    prompt chunks go to SDPA, the local ones' to the flash path; with one group for all layers
    the one plan takes the widest head, and every chunk goes to SDPA."""
    from tests.e2e.oracle import hf_greedy_logprobs, load_hf

    path = cached_tiny_model("gemma4", global_head_dim=512)
    hf = load_hf(str(path))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]
    assert_family_matches_hf(
        path,
        prompts,
        reference,
        MAX_TOKENS,
        attention_backend="native",
        disable_hybrid_kv_cache_manager=not hybrid,
    )


def test_a_lora_adapter_matches_hf_peft(hf_dir, prompts, tmp_path):
    """An adapter on every projection PEFT finds (the readers have no k or v, the global
    layers no v): each layer's side path in its own shape, as HF + PEFT's greedy tokens."""
    from tests.e2e.utils import assert_engine_clean, make_llm
    from tests.fixtures.lora import hf_lora_greedy, hf_lora_model, make_adapter
    from tokenbus import LoRARequest, SamplingParams

    adapter = make_adapter(hf_dir, tmp_path / "adapter", seed=1, r=4)
    hf = hf_lora_model(str(hf_dir), adapter)
    expected = [hf_lora_greedy(hf, prompt, MAX_TOKENS) for prompt in prompts[:4]]
    base = hf_lora_model(str(hf_dir), None)
    assert expected != [hf_lora_greedy(base, prompt, MAX_TOKENS) for prompt in prompts[:4]]
    llm = make_llm(hf_dir, enable_lora=True, max_loras=1, max_lora_rank=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:4]],
        params,
        use_tqdm=False,
        lora_request=LoRARequest("a", str(adapter)),
    )
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert_engine_clean(llm)


def test_lora_on_a_projection_a_layer_lacks_is_refused():
    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.loader.lora import module_shape

    arch = load_arch(resolve_model(str(cached_tiny_model("gemma4"))))
    assert module_shape(arch, "model.layers.2.self_attn.q_proj") == (64, 4 * 32)
    assert module_shape(arch, "model.layers.2.self_attn.k_proj") == (64, 32)
    assert module_shape(arch, "model.layers.5.mlp.down_proj") == (256, 64)
    with pytest.raises(ValueError, match="values are its keys"):
        module_shape(arch, "model.layers.2.self_attn.v_proj")
    with pytest.raises(ValueError, match="attends layer 3's K/V"):
        module_shape(arch, "model.layers.4.self_attn.k_proj")
