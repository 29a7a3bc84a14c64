"""benchmarks/make_random_gguf.py: a small shape written as the real configs are, read back."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from tokenbus.loader.gguf_file import SkippedArray, read_gguf
from tokenbus.loader.model_loader import load_arch
from tokenbus.loader.source import ModelSource
from tokenbus.worker.model_builder import load_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run as a script: its shapes module
_spec = importlib.util.spec_from_file_location(
    "make_random_gguf", ROOT / "benchmarks" / "make_random_gguf.py"
)
make_random_gguf = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = make_random_gguf  # dataclasses look their module up there
_spec.loader.exec_module(make_random_gguf)

SMOLLM2_VOCAB = 49152


def small(config: str) -> make_random_gguf.ModelShape:
    """The config's kind of model (architecture, rope, ties, biases) at a test's size; the
    vocabulary a little past SmolLM2's, so padding is exercised."""
    return dataclasses.replace(
        make_random_gguf.CONFIGS[config],
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=256,
        vocab=SMOLLM2_VOCAB + 64,
    )


@pytest.fixture(
    scope="module",
    params=[
        *("llama-3.1-8b", "qwen2.5-0.5b", "smollm3-3b", "gemma-2b", "gemma-2-2b", "gemma-3-1b"),
        "olmo-2-1b",
    ],
)
def written(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    make_random_gguf.write_random_gguf(request.param, out, shape=small(request.param), quiet=True)
    return request.param, out


def test_header_and_tensors_are_llama_cpp_s(written):
    config, path = written
    shape, gf = small(config), read_gguf(path)
    arch = load_arch(ModelSource("gguf", path))
    assert (arch.architecture, arch.hidden_size, arch.num_hidden_layers) == (
        shape.architecture,
        128,
        2,
    )
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.vocab_size) == (
        4,
        2,
        shape.vocab,
    )
    assert arch.rope_theta == shape.rope_theta and arch.tie_word_embeddings == shape.tied
    assert arch.attention_bias == shape.qkv_bias
    if shape.architecture == "gemma3":  # its first five layers are local
        assert arch.sliding_windows == (shape.sliding_window,) * 2
    if shape.architecture == "gemma2":  # local and global alternate; both soft-caps
        assert arch.sliding_windows == (shape.sliding_window, None)
        assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)
    # The tokenizer's lists are padded to the embedding's rows (llama.cpp's vocab check).
    assert gf.metadata["tokenizer.ggml.tokens"] == SkippedArray(shape.vocab)
    assert gf.metadata["tokenizer.ggml.merges"].length > 0
    assert "tokenizer.chat_template" in gf.metadata
    types = {name: info.qtype for name, info in gf.tensors.items()}
    assert types["token_embd.weight"] == GGMLQuantizationType.F16
    assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType.F16
    first_norm = "post_attention_norm" if shape.architecture == "olmo2" else "attn_norm"
    assert types[f"blk.0.{first_norm}.weight"] == GGMLQuantizationType.F32
    if shape.architecture == "olmo2":  # q/k norms over the whole projection: 4 and 2 heads of 32
        assert gf.tensors["blk.0.attn_q_norm.weight"].shape[0] == 128
        assert gf.tensors["blk.0.attn_k_norm.weight"].shape[0] == 64
    assert ("output.weight" in types) == (not shape.tied)
    assert ("rope_freqs.weight" in types) == (shape.llama3_rope is not None)
    if shape.llama3_rope:  # Llama 3's rope: factors from 1 (high frequencies) to the factor
        factors = arch.rope_scaling["factors"]
        assert len(factors) == 128 // 4 // 2
        assert factors[0] == 1.0 and factors[-1] == shape.llama3_rope[0]


def test_the_engine_loads_every_tensor(written):
    _, path = written
    src = ModelSource("gguf", path)
    model = load_model(src, load_arch(src), torch.float32, "cpu")  # strict: all names known
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(weights).all()
    assert 0.015 < model.layers[0].mlp.down_proj.weight.std().item() < 0.025


def _num_params(shape: make_random_gguf.ModelShape) -> int:
    return sum(int(torch.tensor(s).prod()) for _, s, _ in make_random_gguf.tensor_plan(shape))


def test_the_real_configs_have_the_published_sizes():
    params = {name: _num_params(shape) for name, shape in make_random_gguf.CONFIGS.items()}
    assert 1.22e9 < params["llama-3.2-1b"] < 1.25e9
    assert 3.19e9 < params["llama-3.2-3b"] < 3.22e9
    assert 8.02e9 < params["llama-3.1-8b"] < 8.04e9
    assert 0.49e9 < params["qwen2.5-0.5b"] < 0.5e9
    assert 3.07e9 < params["smollm3-3b"] < 3.09e9
    assert 0.99e9 < params["gemma-3-1b"] < 1.01e9
    assert 2.6e9 < params["gemma-2-2b"] < 2.62e9
    assert 1.48e9 < params["olmo-2-1b"] < 1.49e9
    assert 6.91e9 < params["olmoe-1b-7b"] < 6.93e9
    assert 3.29e9 < params["granite-3b-a800m"] < 3.31e9
    assert 2.50e9 < params["gemma-2b"] < 2.52e9
    # gpt-oss-20b: 20.9 B parameters over its 24 layers; the 8-layer file holds a third of them
    full = dataclasses.replace(make_random_gguf.CONFIGS["gpt-oss-20b-8l"], layers=24)
    assert 20.8e9 < _num_params(full) < 21.0e9
    assert 7.7e9 < params["gpt-oss-20b-8l"] < 7.8e9
    # Qwen1.5-MoE-A2.7B: 14.3 B parameters over its 24 layers
    full = dataclasses.replace(make_random_gguf.CONFIGS["qwen1.5-moe-a2.7b-8l"], layers=24)
    assert 14.3e9 < _num_params(full) < 14.4e9
    # ERNIE-4.5-21B-A3B: 21.8 B parameters over its 28 layers
    full = dataclasses.replace(make_random_gguf.CONFIGS["ernie-4.5-21b-a3b-8l"], layers=28)
    assert 21.7e9 < _num_params(full) < 21.9e9
    assert 1.16e9 < params["lfm2-1.2b"] < 1.18e9  # LFM2-1.2B: 1.17 B
    # LFM2-8B-A1B: 8.3 B parameters over its 24 layers (attention in 2, 6, 10, 14, 18, 21)
    attention = (2, 6, 10, 14, 18, 21)
    full = dataclasses.replace(
        make_random_gguf.CONFIGS["lfm2-8b-a1b-8l"],
        layers=24,
        conv_layers=tuple(i for i in range(24) if i not in attention),
    )
    assert 8.3e9 < _num_params(full) < 8.4e9
    # Qwen3.5-9B: 9.0 B parameters over its 32 layers (attention in every fourth)
    full = dataclasses.replace(
        make_random_gguf.CONFIGS["qwen3.5-9b-8l"],
        layers=32,
        delta_layers=tuple(i for i in range(32) if (i + 1) % 4),
    )
    assert 8.9e9 < _num_params(full) < 9.0e9
    # Qwen3.5-35B-A3B: 34.7 B parameters over its 40 layers
    full = dataclasses.replace(
        make_random_gguf.CONFIGS["qwen3.5-35b-a3b-8l"],
        layers=40,
        delta_layers=tuple(i for i in range(40) if (i + 1) % 4),
    )
    assert 34.6e9 < _num_params(full) < 34.8e9
    assert 1.45e9 < params["granite-4.0-h-1b"] < 1.48e9  # Granite-4.0-H-1B: 1.46 B
    # MiniMax-M2: 228.7 B parameters over its 62 layers of 256 experts
    full = dataclasses.replace(
        make_random_gguf.CONFIGS["minimax-m2-8l-32e"], layers=62, experts=256
    )
    assert 228.6e9 < _num_params(full) < 228.8e9
    # GLM-4.5-Air: 106.9 B parameters over its 46 layers (without its MTP layer)
    full = dataclasses.replace(make_random_gguf.CONFIGS["glm-4.5-air-4l"], layers=46)
    assert 106.8e9 < _num_params(full) < 106.9e9
    # DeepSeek-V2-Lite: 15.7 B parameters over its 27 layers of 64 experts
    full = dataclasses.replace(make_random_gguf.CONFIGS["deepseek-v2-lite-16e"], experts=64)
    assert 15.7e9 < _num_params(full) < 15.71e9
    assert 4.4e9 < params["gemma-3n-e2b"] < 4.5e9  # 2 B of them the per-layer table


def test_lfm2_is_written_as_llama_cpps(tmp_path):
    """Short convolutions (head_count_kv 0 there, their taps, shortconv.* tensors) among
    attention layers, the final norm as token_embd_norm: read back by the loader and loaded
    whole by the engine."""
    shape = dataclasses.replace(small("lfm2-1.2b"), layers=3, conv_layers=(0, 2))
    path = make_random_gguf.write_random_gguf("lfm2", tmp_path / "l.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.recurrent_layers, arch.conv_kernel) == ("lfm2", (0, 2), 3)
    assert (arch.num_key_value_heads, arch.num_kv_layers) == (2, 1)
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[2].mixer.weight.shape == (shape.hidden, 3)
    assert model.norm.weight.eq(1).all()


def test_lfm2_moe_is_written_as_llama_cpps(tmp_path):
    """LFM2's layers, a dense first MLP, then experts with the selection bias and sigmoid
    scores (expert_gating_func): read back by the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("lfm2-8b-a1b-8l"),
        layers=3,
        conv_layers=(0, 2),
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        dense_lead=1,
    )
    path = make_random_gguf.write_random_gguf(
        "lfm2moe", tmp_path / "m.gguf", shape=shape, quiet=True
    )
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.recurrent_layers, arch.dense_layers) == (
        "lfm2_moe",
        (0, 2),
        (0,),
    )
    assert (arch.moe_scoring, arch.moe_selection_bias, arch.num_experts) == ("sigmoid", True, 4)
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[2].mlp.selection_bias.abs().sum() > 0


def test_qwen3_5_is_written_as_llama_cpps(tmp_path):
    """Gated DeltaNet layers (ssm.* keys, attn_qkv / attn_gate / ssm_* tensors) and a gated
    attention layer (attn_q twice the queries), post_attention_norm: read back by the loader
    and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("qwen3.5-9b-8l"),
        layers=4,
        delta_layers=(0, 1, 2),
        delta_k_heads=2,
        delta_v_heads=4,
        delta_dim=32,
        head_dim_override=32,
    )
    path = make_random_gguf.write_random_gguf(
        "qwen35", tmp_path / "q.gguf", shape=shape, quiet=True
    )
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.recurrent_layers, arch.rotary_dim) == ("qwen3_5", (0, 1, 2), 8)
    assert (arch.delta_k_heads, arch.delta_v_heads, arch.delta_v_dim) == (2, 4, 32)
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[0].mixer.A.tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert model.norm.weight.eq(1).all()  # stored as 1 + w, read as w, held as 1 + w


def test_qwen3_5_moe_is_written_as_llama_cpps(tmp_path):
    """Qwen3.5's layers with experts in every one and a gated shared expert, no dense width
    (feed_forward_length absent): read back by the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("qwen3.5-35b-a3b-8l"),
        layers=4,
        intermediate=0,
        delta_layers=(0, 1, 2),
        delta_k_heads=2,
        delta_v_heads=4,
        delta_dim=32,
        head_dim_override=32,
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        shared_intermediate=64,
    )
    path = make_random_gguf.write_random_gguf("q35m", tmp_path / "q.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.intermediate_size, arch.num_experts) == ("qwen3_5_moe", 64, 4)
    assert arch.shared_expert_gated and arch.dense_layers == ()
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[3].mlp.shared_expert_gate is not None


def test_ernie_moe_is_written_as_llama_cpps(tmp_path):
    """A dense first layer, the selection bias, the ungated shared MLP: read back by the loader
    and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("ernie-4.5-21b-a3b-8l"),
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        shared_intermediate=128,
        head_dim_override=0,
    )
    path = make_random_gguf.write_random_gguf("ernie", tmp_path / "e.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.dense_layers) == ("ernie4_5_moe", (0,))
    assert arch.moe_selection_bias and not arch.shared_expert_gated
    assert arch.shared_expert_intermediate_size == 128
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[1].mlp.selection_bias.abs().sum() > 0


def test_qwen2_moe_is_written_as_llama_cpps(tmp_path):
    """The shared expert (its gate a [hidden] vector) beside stacked experts: read back by the
    loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("qwen1.5-moe-a2.7b-8l"),
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        shared_intermediate=96,
    )
    path = make_random_gguf.write_random_gguf("qmoe", tmp_path / "q.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.shared_expert_intermediate_size) == ("qwen2_moe", 96)
    assert not arch.norm_topk_prob and arch.attention_bias
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    mlp = model.layers[0].mlp
    assert mlp.shared_expert_gate.weight.shape == (1, shape.hidden)
    assert mlp.shared_expert.down_proj.weight.shape == (shape.hidden, 96)


def test_moe_config_writes_stacked_experts_the_engine_loads(tmp_path):
    """The Qwen3-MoE shape (at a test's size): experts stacked per layer, F32 router, q/k
    norms; our loader maps and loads every tensor."""
    shape = dataclasses.replace(
        small("qwen3-30b-a3b-8l"), experts=8, experts_used=2, expert_intermediate=64
    )
    path = make_random_gguf.write_random_gguf("moe", tmp_path / "moe.gguf", shape=shape, quiet=True)
    types = {name: info.qtype for name, info in read_gguf(path).tensors.items()}
    assert types["blk.0.ffn_gate_inp.weight"] == GGMLQuantizationType.F32
    assert types["blk.1.ffn_down_exps.weight"] == GGMLQuantizationType.F16
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.num_experts, arch.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert (arch.head_dim, arch.moe_intermediate_size) == (128, 64)
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    down = model.layers[1].mlp.experts[7].down_proj.weight
    assert down.shape == (128, 64) and 0.015 < down.std().item() < 0.025


def test_gpt_oss_is_written_as_llama_cpps(tmp_path):
    """Biases on attention, router and experts, sinks, the post-attention norm, the window and
    YaRN: read back by the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("gpt-oss-20b-8l"),
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        head_dim_override=32,
    )
    path = make_random_gguf.write_random_gguf(
        "gpt-oss-20b-8l", tmp_path / "oss.gguf", shape=shape, quiet=True
    )
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.num_experts, arch.num_experts_per_tok) == ("gpt_oss", 4, 2)
    assert arch.sliding_windows == (128, None) and arch.attention_bias
    assert arch.rope_scaling == {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    }
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert torch.isfinite(model.layers[0].self_attn.sinks).all()
    assert model.layers[1].mlp.experts[3].down_proj.bias.abs().max() > 0


def test_granite_hybrid_is_written_as_llama_cpps(tmp_path):
    """Mamba2 mixers (head_count_kv 0 there, ssm.* keys, ssm_a / ssm_d without a suffix) around
    an attention layer without a rotary: read back by the loader and loaded whole by the
    engine, A negative as HF's -exp(A_log)."""
    shape = dataclasses.replace(
        small("granite-4.0-h-1b"),
        layers=3,
        ssm_layers=(0, 2),
        ssm_heads=8,
        ssm_head_dim=32,
        ssm_state=16,
    )
    path = make_random_gguf.write_random_gguf("gh", tmp_path / "g.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.recurrent_layers) == ("granitemoehybrid", (0, 2))
    assert (arch.mamba_heads, arch.mamba_head_dim, arch.mamba_state) == (8, 32, 16)
    assert (arch.num_key_value_heads, arch.nope_layers) == (2, (0, 1, 2))
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    mixer = model.layers[2].mixer
    torch.testing.assert_close(mixer.A, -torch.arange(1.0, 9.0))
    assert mixer.conv_weight.shape == (8 * 32 + 2 * 16, 4)


def test_glm4_moe_is_written_as_llama_cpps(tmp_path):
    """q/k/v biases, half of each head turning, a dense first layer, then experts chosen with a
    bias beside an ungated shared expert, the pre-MLP norm as post_attention_norm: read back by
    the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("glm-4.5-air-4l"),
        layers=3,
        head_dim_override=32,
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        shared_intermediate=64,
    )
    path = make_random_gguf.write_random_gguf("glm", tmp_path / "g.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.dense_layers, arch.rotary_dim) == ("glm4_moe", (0,), 16)
    assert (arch.moe_scoring, arch.moe_selection_bias, arch.num_experts) == ("sigmoid", True, 4)
    assert (arch.shared_expert_intermediate_size, arch.shared_expert_gated) == (64, False)
    assert arch.attention_bias and arch.norm_topk_prob and not arch.attn_qk_norm
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[2].mlp.selection_bias.abs().sum() > 0


def test_minimax_m2_is_written_as_llama_cpps(tmp_path):
    """Whole-projection q/k norms, half of each head turning, experts chosen with a bias in every
    layer (sigmoid gating): read back by the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("minimax-m2-8l-32e"),
        head_dim_override=32,
        experts=4,
        experts_used=2,
        expert_intermediate=64,
    )
    path = make_random_gguf.write_random_gguf("mm", tmp_path / "m.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.dense_layers, arch.rotary_dim) == ("minimax_m2", (), 16)
    assert (arch.moe_scoring, arch.moe_selection_bias, arch.num_experts) == ("sigmoid", True, 4)
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[0].self_attn.q_norm.weight.shape == (4 * 32,)


def test_deepseek_v2_is_written_as_llama_cpps(tmp_path):
    """Latent attention (one KV head of the latent and the turned key, kv_b_proj split per head
    into attn_k_b and attn_v_b), YaRN with its log multiplier, a dense first layer, then
    softmax-routed experts beside an ungated shared MLP: read back by the loader and loaded
    whole by the engine."""
    shape = dataclasses.replace(
        small("deepseek-v2-lite-16e"),
        layers=3,
        kv_heads=1,
        head_dim_override=64 + 32,
        kv_lora_rank=64,
        qk_nope_dim=32,
        qk_rope_dim=32,
        v_head_dim=32,
        experts=4,
        experts_used=2,
        expert_intermediate=64,
        shared_intermediate=128,
    )
    path = make_random_gguf.write_random_gguf("ds", tmp_path / "d.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.dense_layers, arch.num_key_value_heads) == (
        "deepseek_v2",
        (0,),
        1,
    )
    assert (arch.head_dim, arch.rotary_dim, arch.kv_lora_rank, arch.v_head_dim) == (96, 32, 64, 32)
    assert (arch.moe_scoring, arch.norm_topk_prob, arch.shared_expert_intermediate_size) == (
        "softmax",
        False,
        128,
    )
    assert arch.rope_scaling["mscale_all_dim"] == pytest.approx(0.707)
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[1].self_attn.w_uk.shape == (4, 32, 64)


def test_gemma3n_is_written_as_llama_cpps(tmp_path):
    """Per-layer inputs (their table and projection), the AltUp projections stacked, each
    layer's AltUp, LAuReL and per-layer tensors, the last layers reading earlier layers' K/V,
    the first MLPs sparse: read back by the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("gemma-3n-e2b"),
        layers=10,
        head_dim_override=32,
        per_layer_input=16,
        kv_shared=5,
        sparse_layers=2,
    )
    path = make_random_gguf.write_random_gguf("g", tmp_path / "g.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert (arch.architecture, arch.num_kv_layers, arch.per_layer_input_size) == ("gemma3n", 5, 16)
    assert dict(arch.kv_shared_layers) == {5: 3, 6: 3, 7: 3, 8: 3, 9: 4}
    assert arch.activation_sparsity_std == (pytest.approx(1.6448536),) * 2 + (None,) * 8
    assert (arch.rope_local_theta, arch.final_logit_softcapping, arch.laurel_rank) == (
        10000.0,
        30.0,
        64,
    )
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.embed_tokens_per_layer.shape == (SMOLLM2_VOCAB + 64, 10 * 16)


def test_gemma4_is_written_as_llama_cpps(tmp_path):
    """Each kind of layer in its own shape (the global ones' wider heads, fewer KV heads), the
    global layers' proportional rope as rope_freqs, per-layer inputs, each layer's output
    scale: read back by the loader and loaded whole by the engine."""
    shape = dataclasses.replace(
        small("gemma-4-config-defaults"),
        layers=6,
        head_dim_override=32,
        global_head_dim=64,
        global_kv_heads=1,
        per_layer_input=16,
    )
    path = make_random_gguf.write_random_gguf("g", tmp_path / "g.gguf", shape=shape, quiet=True)
    src = ModelSource("gguf", path)
    arch = load_arch(src)
    assert arch.architecture == "gemma4" and arch.sliding_windows == (512,) * 5 + (None,)
    assert arch.layer_kv_shapes == ((2, 32),) * 5 + ((1, 64),)
    assert (arch.head_dim, arch.global_head_dim, arch.per_layer_input_size) == (32, 64, 16)
    factors = arch.rope_scaling["factors"]  # a quarter of the 32 angles turn
    assert factors[:8] == (1.0,) * 8 and min(factors[8:]) > 1e29 and len(factors) == 32
    model = load_model(src, arch, torch.float32, "cpu")  # strict: all names known
    assert model.layers[5].self_attn.qkv_proj.weight.shape == ((4 + 2) * 64, 128)
    # transformers builds 5,077,177,856 parameters of that config (+ 30 layer scalars, 256 rope
    # factors here)
    assert 5.0771e9 < _num_params(make_random_gguf.CONFIGS["gemma-4-config-defaults"]) < 5.0772e9
