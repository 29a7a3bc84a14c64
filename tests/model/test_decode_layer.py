"""The fused CPU ops (fused_ops.c) against torch, and a whole decoder layer in C
(decode_layer.c) against the layer-by-layer path on the same kernels: bit for bit."""

from __future__ import annotations

import dataclasses
import os
import shutil

import gguf
import pytest
import torch
import torch.nn.functional as F
from tests.fixtures.paged import PagedKV
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.loader import load_arch, resolve_model
from tokenbus.model.layers import TORCH_OPS, Linear
from tokenbus.model.layers.quantized import QuantizedLinearKernel, TileModes
from tokenbus.model.layers.rotary import apply_rotary
from tokenbus.model.native import load_fused_ops, load_quant_kernels
from tokenbus.utils.cpu import CpuFeatures
from tokenbus.worker.model_builder import load_model

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the native kernels cannot be built here",
)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 576: OpenMP splits the rows
def test_fused_ops_equal_torch(rows):
    ops = load_fused_ops()
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    for res in (None, residual):
        out, res_out = ops.add_rms_norm(x, res, weight, 1e-5)
        want_res = x if res is None else x + res
        torch.testing.assert_close(res_out, want_res)
        torch.testing.assert_close(
            out, F.rms_norm(want_res, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5
        )
    qkv = torch.randn(rows, 15 * 64, generator=g)  # 9 q + 3 k heads rotated, 3 v heads left alone
    angles = torch.rand(rows, 1, 32, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    want = qkv.view(rows, 15, 64).clone()
    want[:, :12] = apply_rotary(want[:, :12], cos, sin)
    ops.rope_(qkv, cos.view(rows, 32), sin.view(rows, 32), 12, 64)
    torch.testing.assert_close(qkv.view(rows, 15, 64), want, rtol=1e-5, atol=1e-5)
    partial = qkv.view(rows, 15, 64).clone()  # Phi-4-mini's: the first 48 of 64 turn
    cos, sin = cos[..., :24].contiguous(), sin[..., :24].contiguous()
    partial[:, :12] = apply_rotary(partial[:, :12], cos, sin)
    ops.rope_(qkv, cos.view(rows, 24), sin.view(rows, 24), 12, 64, rotary_dim=48)
    torch.testing.assert_close(qkv.view(rows, 15, 64), partial, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(rows, 2 * 1536, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        ops.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5
    )
    # gpt-oss's clamped SwiGLU: gate * 3 puts values past the limit on both sides
    gate_up = gate_up * 3
    want = TORCH_OPS.clamped_swiglu_mul(gate_up, 7.0, 1.702)
    torch.testing.assert_close(
        ops.clamped_swiglu_mul(gate_up, 7.0, 1.702), want, rtol=1e-5, atol=1e-5
    )
    gate, up = gate_up.chunk(2, dim=-1)  # HF's GptOssExperts._apply_gate, written out
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(want, gate * torch.sigmoid(gate * 1.702) * (up + 1))
    assert (gate_up.abs() > 7).any()


def q4_k_m_mix(name: str) -> str:
    return "Q6_K" if "attn_v" in name or "ffn_up" in name else "Q4_K"


def k_quant_and_32_value_mix(name: str) -> str:
    """Q4_K and Q6_K shards beside Q8_0 and Q4_0 ones: calls on both kinds in one step."""
    return "Q8_0" if "attn_k" in name or "ffn_gate" in name else q4_k_m_mix(name)


def _model(tmp_path, arch: str, qtype, window: int | None = None, config=None, **kwargs):
    overrides = dict(hidden_size=256, intermediate_size=512, **(config or {}))
    if window is not None:
        overrides["sliding_window"] = window
    path = write_gguf(
        cached_tiny_model(arch, **overrides), tmp_path / f"{arch}.gguf", qtype, with_tokenizer=False
    )
    src = resolve_model(str(path))
    return load_model(src, load_arch(src), kwargs.pop("dtype", torch.float32), "cpu", **kwargs)


class _LayerHooks:
    """A KV connector that only records its per-layer calls (so the layers run one C call each)."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, kv: torch.Tensor) -> None:
        self.saved.append(layer_idx)


def _steps(
    model, use_c: bool, kv_dtype: torch.dtype = torch.float32, connector: _LayerHooks | None = None
) -> list[torch.Tensor]:
    """Logits of a few steps: a prefill, decodes of two requests, a mixed step."""
    saved = model.kernels
    if not use_c:
        model.kernels = saved.without_decode_layers()
    try:
        kv = PagedKV.for_model(model, kv_dtype=kv_dtype)
        batches = [
            [("a", [5, 6, 7, 8, 9, 10])],
            [("a", [11])],
            [("a", [12]), ("b", [3, 4, 5])],
            [("a", [13]), ("b", [6])],
            [("b", [7]), ("a", [14])],
        ]
        out = []
        for batch in batches:
            input_ids, ctx = kv.step(batch)
            ctx.kv_connector = connector
            with torch.inference_mode():
                out.append(model.compute_logits(model(input_ids, ctx)))
        return out
    finally:
        model.kernels = saved


@pytest.mark.parametrize(
    "arch, qtype, activations, kv_dtype",
    [
        ("llama", "Q4_1", "auto", torch.float32),
        ("llama", "Q8_0", "int8", torch.float32),
        ("qwen2", "Q4_0", "fp32", torch.float32),  # qwen2: q/k/v biases
        ("llama", "Q4_1", "bf16", torch.float32),  # AVX512-BF16 (AMX or not) only
        ("llama", "Q4_1", "auto", torch.float16),
        ("llama", "Q4_1", "auto", torch.float8_e4m3fn),
        ("llama", "Q8_0", "int8", torch.float8_e5m2),
        ("llama", "Q4_1", "auto", torch.uint8),
        ("llama", "Q4_K", "auto", torch.float32),  # K-quants on tiles
        ("llama", "Q6_K", "int8", torch.float32),
        ("qwen3", "Q8_0", "auto", torch.float32),  # qwen3: q/k norms in C, head_dim 128
        ("qwen3", "Q4_0", "int8", torch.uint8),
        ("hunyuan_v1_dense", "Q8_0", "auto", torch.float32),  # q/k norms after the rotary
        # a mix as Q4_K_M's: q/k/v and gate/up each shards of two types (Q4_K, Q6_K)
        ("llama", q4_k_m_mix, "auto", torch.float32),
        ("llama", q4_k_m_mix, "q8_k", torch.float32),  # AVX-512 VNNI only
        ("qwen2", "Q8_0", "q8_k", torch.float32),  # a 32-value type (K 256: one group)
    ],
)  # --kv-cache-dtype float16 (the default on GGUF blocks), fp8_e4m3, fp8_e5m2, q8_0: written
# in C by decode_layer.c, in torch by the layer-by-layer path (kv_quant.h / kv_quant.py)
def test_decoder_layer_in_c_equals_the_layer_by_layer_path(
    tmp_path, arch, qtype, activations, kv_dtype
):
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    if activations == "bf16" and not load_quant_kernels().bf16_engine:
        pytest.skip(f"bf16 tiles need AVX512-BF16; this CPU is {CpuFeatures.detect().describe()}")
    if activations == "q8_k" and not load_quant_kernels().q8_k:
        pytest.skip(f"q8_k needs AVX-512 VNNI; this CPU is {CpuFeatures.detect().describe()}")
    model = _model(tmp_path, arch, qtype, quantization="gguf", quant_activations=activations)
    layers = model.kernels.decode_layers
    assert layers is not None
    calls, per_layer = [], []
    run_all, run = layers.run_all, layers.run
    layers.run_all = lambda n, *args: (calls.append(n), run_all(n, *args))
    layers.run = lambda *args: (per_layer.append(args[0]), run(*args))
    want = _steps(model, False, kv_dtype)
    for got, expected in zip(_steps(model, True, kv_dtype), want):
        assert torch.equal(got, expected)
    assert calls == [model.num_layers] * 5 and not per_layer  # every step's layers in one C call
    hooks = _LayerHooks()  # a connector between layers: one C call per layer, the same logits
    for got, expected in zip(_steps(model, True, kv_dtype, hooks), want):
        assert torch.equal(got, expected)
    assert per_layer == list(range(model.num_layers)) * 5 and hooks.saved == per_layer


@pytest.mark.parametrize(
    "family, qtype, activations, kv_dtype",
    [
        ("gemma3", "Q8_0", "auto", torch.float32),
        ("gemma3", "Q4_0", "int8", torch.float16),
        ("gemma2", "Q8_0", "auto", torch.float32),
    ],
)
def test_gemma_layers_in_c_equal_the_layer_by_layer_path(
    tmp_path, family, qtype, activations, kv_dtype
):
    """Gemma's sandwich norms and GeGLU in C, with Gemma 3's (1 + w) q/k norms and its local
    layers' own rotary table, Gemma 2's soft-capped scores, and windows of 8 (the steps reach
    14 tokens): the same logits, bit for bit."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    model = _model(
        tmp_path, family, qtype, window=8, quantization="gguf", quant_activations=activations
    )
    layers = model.kernels.decode_layers
    assert layers is not None and layers.num_rope_tables == (2 if family == "gemma3" else 1)
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    assert windows == ([8] * 5 + [None] if family == "gemma3" else [8, None])
    want = _assert_c_steps_equal_layer_by_layer(model, kv_dtype)
    for got, expected in zip(_steps(model, True, kv_dtype, _LayerHooks()), want):
        assert torch.equal(got, expected)


# Gemma 4's kinds: E2B's (per-layer inputs, the last two layers reading layers 3's and 2's
# K/V), the 31B's (neither) and the 26B-A4B's (the 31B's with experts beside the MLP)
GEMMA4_DENSE = dict(
    hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False
)
GEMMA4_MOE = dict(
    GEMMA4_DENSE, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=256
)


@pytest.mark.parametrize(
    "qtype, activations, kv_dtype, config",
    [
        ("Q8_0", "auto", torch.float32, {}),
        ("Q4_0", "int8", torch.float16, {}),
        ("Q8_0", "int8", torch.float32, GEMMA4_DENSE),
    ],
)
def test_gemma4_layers_in_c_equal_the_layer_by_layer_path(
    tmp_path, qtype, activations, kv_dtype, config
):
    """Gemma 4's layers in C: local layers of 2 KV heads of 16 (windows of 8; the steps reach
    14 tokens) and global ones of 1 KV head of 32 whose values are their keys, each turning by
    its own table (the global one proportional), v's weightless norm, the per-layer inputs
    joined, each layer's scalar, and layers attending another's K/V: the same logits, bit for
    bit."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    sizes = dict(hidden_size_per_layer_input=32, sliding_window=8)
    options = dict(quantization="gguf", quant_activations=activations)
    model = _model(tmp_path, "gemma4", qtype, config={**sizes, **config}, **options)
    layers = model.kernels.decode_layers
    assert layers is not None and layers.num_rope_tables == 2
    assert [layer.self_attn.head_dim for layer in model.layers] == [16, 16, 32, 16, 16, 32]
    shares = [layer.self_attn.owner is not None for layer in model.layers]
    assert shares == [False] * 4 + [not config] * 2
    assert layers.per_layer_width == (None if config else 32)
    _assert_c_steps_equal_layer_by_layer(model, kv_dtype)


def test_gemma4_c_layers_refuse_shapes_they_cannot_read(tmp_path):
    """A rotary table wider than a layer's heads (the global one on a local layer) and a
    per-layer input's norm of another width are refused before C reads past them."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    config = dict(hidden_size_per_layer_input=32)
    model = _model(tmp_path, "gemma4", "Q8_0", quantization="gguf", config=config)
    input_ids, ctx = PagedKV.for_model(model).step([("a", [5])])
    lookup = model.rotary_lookup
    model.rotary_lookup = lambda *args: tuple(table[::-1] for table in lookup(*args))
    with pytest.raises(ValueError, match="layer 0 turns 32 of its heads' 16"):
        with torch.inference_mode():
            model(input_ids, ctx)
    layer = model.kernels.decode_layers._weights[0]
    joins = dataclasses.replace(layer.per_layer_input, norm=torch.ones(7))
    with pytest.raises(ValueError, match="do not fit a hidden size of 256"):
        dataclasses.replace(layer, per_layer_input=joins).struct()


def test_gemma4_experts_in_c_match_the_layer_by_layer_path(tmp_path):
    """The 26B-A4B's tanh-GELU experts beside each MLP in C: the router reading the residual
    stream normed without a weight and scaled, the per-expert scales, the experts' own norms: the
    layer-by-layer path's logits to float rounding (C's norm and expf against torch's)."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    model = _model(tmp_path, "gemma4", "Q8_0", quantization="gguf", config=GEMMA4_MOE)
    assert all(layer.experts is not None for layer in model.layers)
    g = torch.Generator().manual_seed(0)
    for layer in model.layers:  # trained scales, not HF's initial ones
        for scale in (layer.experts.router_scale, layer.experts.per_expert_scale):
            scale.copy_(torch.rand(scale.shape, generator=g) + 0.5)
    _assert_c_steps_match_layer_by_layer(model)


@pytest.mark.parametrize("k_mode", ["q8_k", "int8"])
def test_k_quant_shards_take_their_own_activations_in_c(tmp_path, k_mode):
    """auto's q8_k (int8 on AVX2) from some rows up is for K-quant shards only: in one decode
    step the C layers run those on it and the Q8_0 ones on int16 (step.k_activations), as the
    layer-by-layer path does shard by shard."""
    kernels = load_quant_kernels()
    if k_mode == "q8_k" and not kernels.q8_k:
        pytest.skip(f"q8_k needs AVX-512 VNNI; this CPU is {CpuFeatures.detect().describe()}")
    if kernels.tile_fns is None:
        pytest.skip(f"no tiled kernels on {CpuFeatures.detect().describe()}")
    model = _model(tmp_path, "llama", k_quant_and_32_value_mix, quantization="gguf")
    # every call past 0 rows
    modes = TileModes("int16", 0, 0, k_quant_from_rows=1, k_quant_activations=k_mode)
    model.kernels = dataclasses.replace(model.kernels, tile_modes=modes)
    linears = [m.kernel for m in model.modules() if isinstance(m, Linear)]
    for kernel in linears:
        if isinstance(kernel, QuantizedLinearKernel):
            kernel.modes = modes
    taken = []
    tile_matmul = model.quant_kernels.tile_matmul
    spy = lambda qtype, *args: (taken.append((qtype, args[-1])), tile_matmul(qtype, *args))  # noqa: E731
    object.__setattr__(model.quant_kernels, "tile_matmul", spy)
    want = _steps(model, False)
    assert {(gguf.GGMLQuantizationType(q).name, mode) for q, mode in taken} >= {
        ("Q8_0", "int16"),
        ("Q4_K", k_mode),
        ("Q6_K", k_mode),
    }
    for got, expected in zip(_steps(model, True), want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["dequantized", "k-quant", "bf16"])
def test_decoder_layer_in_c_only_where_it_applies(tmp_path, case):
    """Dense weights, blocks not tiled (Q2_K) and bf16 run layer by layer, as before."""
    if case == "dequantized":
        model = _model(tmp_path, "llama", "Q4_1", quantization="none")
    elif case == "k-quant":
        model = _model(tmp_path, "llama", "Q2_K", quantization="gguf")
    else:
        model = _model(tmp_path, "llama", "Q4_1", quantization="gguf", dtype=torch.bfloat16)
    assert not model.decodes_in_c


def _assert_c_steps_equal_layer_by_layer(model, kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """Every step of `model` runs all its layers in one C call and gives the layer-by-layer
    path's logits bit for bit; those logits."""
    layers = model.kernels.decode_layers
    calls, run_all = [], layers.run_all
    layers.run_all = lambda n, *args: (calls.append(n), run_all(n, *args))
    want = _steps(model, False, kv_dtype)
    for got, expected in zip(_steps(model, True, kv_dtype), want):
        assert torch.equal(got, expected)
    assert calls == [model.num_layers] * 5
    return want


def _assert_c_steps_match_layer_by_layer(model) -> None:
    """Every decode step of `model` runs all its layers in C and gives the layer-by-layer
    path's logits to float rounding (an MoE's routing weights: C's expf against torch's
    softmax or sigmoid), with the same argmax."""
    layers = model.kernels.decode_layers
    assert layers is not None and model.decodes_in_c
    calls, run_all = [], layers.run_all
    layers.run_all = lambda n, *args: (calls.append(n), run_all(n, *args))
    want = _steps(model, False)
    for got, expected in zip(_steps(model, True), want):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert calls == [model.num_layers] * 5  # every step is decode-sized: all in C


@pytest.mark.parametrize(
    "family, qtype, config",
    [
        ("qwen3_moe", "Q8_0", dict(num_experts=8, num_experts_per_tok=2, head_dim=64)),
        ("qwen3_moe", "Q4_K", dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
        ("mixtral", "Q4_0", dict(num_local_experts=4, num_experts_per_tok=2)),
        ("olmoe", "Q8_0", dict(num_experts=4, num_experts_per_tok=2)),  # whole q/k norms
        ("granitemoe", "Q8_0", dict(num_local_experts=4, num_experts_per_tok=2)),  # multipliers
        ("qwen3_moe", "MXFP4", dict(num_experts=8, num_experts_per_tok=2, head_dim=64)),  # gpt-oss
        # a shared expert beside the routed ones, q/k/v biases
        ("qwen2_moe", "Q8_0", dict(num_experts=4, num_experts_per_tok=2, head_dim=64)),
        # ERNIE 4.5: experts chosen by probability + bias, an ungated shared MLP, a dense layer
        (
            "ernie4_5_moe",
            "Q8_0",
            dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1),
        ),
        # GLM-4.5: sigmoid scores + bias, renormalised with 1e-20, scaled, an ungated shared
        # expert, q/k norms; the choice within the best 2 of 4 groups too, from a GGUF and from
        # safetensors rounded to Q8_0 at load
        ("glm4_moe", "Q4_K", dict(head_dim=64)),
        ("glm4_moe", "Q8_0", dict(n_group=4, topk_group=2, num_experts_per_tok=3)),
        ("glm4_moe", "q8_0", dict(n_group=4, topk_group=2, num_experts_per_tok=3)),
    ],
)
def test_moe_layer_in_c_matches_the_layer_by_layer_path(tmp_path, family, qtype, config):
    """An MoE layer in C: the router on the same dense_rows.c panels (so the same experts), the
    routing weights by C's expf instead of torch's softmax or sigmoid (so equal to float
    rounding). A lower-case qtype: the safetensors model rounded to it at load."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    sizes = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256)
    if family == "qwen2_moe":
        sizes["shared_expert_intermediate_size"] = 384
    hf_dir = cached_tiny_model(family, **sizes, **config)
    if qtype.islower():
        src = resolve_model(str(hf_dir))
        model = load_model(src, load_arch(src), torch.float32, "cpu", quantization=qtype)
    else:
        path = write_gguf(hf_dir, tmp_path / f"{family}.gguf", qtype, with_tokenizer=False)
        src = resolve_model(str(path))
        model = load_model(src, load_arch(src), torch.float32, "cpu", quantization="gguf")
    assert (model.arch.moe_groups, model.arch.moe_topk_groups) == (
        (config["n_group"], config["topk_group"]) if "n_group" in config else (1, 1)
    )
    _assert_c_steps_match_layer_by_layer(model)


@pytest.mark.parametrize(
    "family, qtype",
    [
        ("deepseek_v2", "Q8_0"),  # no query bottleneck, YaRN, pairs turning, softmax routing
        ("deepseek_v3", "Q8_0"),  # a query bottleneck, sigmoid routing in groups
        ("minicpm3", "Q8_0"),  # halves turning, a dense MLP, muP's scales
        ("deepseek_v3", "q8_0"),  # from safetensors rounded to Q8_0 at load
    ],
)
def test_latent_attention_layers_in_c_match_the_layer_by_layer_path(tmp_path, family, qtype):
    """Multi-head latent attention in C: the query, the latent and its norm, the turned dims,
    each head absorbed through W_UK, one KV head written and read, W_UV after; the layer's
    logits to float rounding, the same argmax. A lower-case qtype: rounded at load."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    hf_dir = cached_tiny_model(family)
    if qtype.islower():
        src = resolve_model(str(hf_dir))
        model = load_model(src, load_arch(src), torch.float32, "cpu", quantization=qtype)
    else:
        path = write_gguf(hf_dir, tmp_path / f"{family}.gguf", qtype, with_tokenizer=False)
        src = resolve_model(str(path))
        model = load_model(src, load_arch(src), torch.float32, "cpu", quantization="gguf")
    assert model.arch.kv_lora_rank and model.kernels.decode_layers._layers[0].mla
    _assert_c_steps_match_layer_by_layer(model)


@pytest.mark.parametrize("source", ["gguf-mxfp4", "q8_0-tight-clamp"])
def test_gpt_oss_layers_in_c_match_the_layer_by_layer_path(tmp_path, source):
    """gpt-oss's layers in C: sinks, biases on attention, router and experts, the clamped
    SwiGLU, alternating windows (the steps outgrow them). From an MXFP4 GGUF (llama.cpp's
    limit, 7), and from safetensors rounded to Q8_0 with a limit of 0.5, which clamps most
    values (the GGUF cannot say it): the same steps to float rounding, the same argmax."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    config = dict(hidden_size=256, intermediate_size=256, head_dim=64, sliding_window=4)
    if source == "gguf-mxfp4":
        hf_dir = cached_tiny_model("gpt_oss", **config)
        src = resolve_model(str(write_gguf(hf_dir, tmp_path / "oss.gguf", "MXFP4", False)))
        model = load_model(src, load_arch(src), torch.float32, "cpu", quantization="gguf")
    else:
        src = resolve_model(str(cached_tiny_model("gpt_oss", **config, swiglu_limit=0.5)))
        model = load_model(src, load_arch(src), torch.float32, "cpu", quantization="q8_0")
        assert model.layers[0].mlp.swiglu == (0.5, 1.702)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [4, None]
    _assert_c_steps_match_layer_by_layer(model)


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
def test_windowed_layers_in_c_equal_the_layer_by_layer_path(tmp_path, partial_rotary_factor):
    """Phi-3's sliding window on every layer (a GGUF's phi3.attention.sliding_window): the C
    layer tells the attention kernel the window as the layer-by-layer path does, and the
    steps' contexts outgrow it; Phi-4-mini's partial rotary turns the first 3/4 of each head
    in C too: the same logits, bit for bit."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    config = dict(hidden_size=256, intermediate_size=512, sliding_window=4)
    config |= dict(partial_rotary_factor=partial_rotary_factor)
    hf_dir = cached_tiny_model("phi3", **config)
    path = write_gguf(hf_dir, tmp_path / "phi3.gguf", "Q8_0", with_tokenizer=False)
    src = resolve_model(str(path))
    model = load_model(src, load_arch(src), torch.float32, "cpu", quantization="gguf")
    assert {layer.self_attn.sliding_window for layer in model.layers} == {4}
    assert model.rotary.is_partial == (partial_rotary_factor < 1)
    layers = model.kernels.decode_layers
    assert layers is not None
    calls, run_all = [], layers.run_all
    layers.run_all = lambda n, *args: (calls.append(n), run_all(n, *args))
    want = _steps(model, False)
    for got, expected in zip(_steps(model, True), want):
        assert torch.equal(got, expected)
    assert calls == [model.num_layers] * 5


def test_attention_sinks_in_c_equal_the_layer_by_layer_path(tmp_path):
    """gpt-oss's attention sinks (decoder.Attention.sinks) reach the C layer's attention: the
    same kernel call as the layer-by-layer path, so the same logits bit for bit; and the sinks
    change them."""
    if not CpuFeatures.detect().has("avx2", "fma"):
        pytest.skip(f"tiled kernels need AVX2; this CPU is {CpuFeatures.detect().describe()}")
    model = _model(tmp_path, "llama", "Q8_0", quantization="gguf")
    plain = _steps(model, True)
    g = torch.Generator().manual_seed(0)
    for layer in model.layers:
        layer.self_attn.sinks = torch.randn(layer.self_attn.num_heads, generator=g) * 2 + 1
    model.kernels = model.kernels.with_decode_layers(model)
    layers = model.kernels.decode_layers
    assert layers is not None
    calls, run_all = [], layers.run_all
    layers.run_all = lambda n, *args: (calls.append(n), run_all(n, *args))
    want = _steps(model, False)
    for got, expected, before in zip(_steps(model, True), want, plain):
        assert torch.equal(got, expected)
        assert (got - before).abs().max() > 1e-3
    assert calls == [model.num_layers] * 5
