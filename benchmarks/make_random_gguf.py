"""Write a random-weight F16 GGUF of a real model's shape, for benchmarks at the sizes people run.

    .venv/bin/python benchmarks/make_random_gguf.py llama-3.2-1b [--out FILE] [--seed 0]
    benchmarks/peers/llama_cpp.sh quantize FILE.gguf FILE-Q4_K_M.gguf Q4_K_M   # then quantize

Configs (CONFIGS below, most with a comment giving the real model's shape; "-8l": its first 8
layers): Llama 3.x (rope factors as rope_freqs.weight, as llama.cpp's converter writes them),
Qwen2.5 (q/k/v biases; 896 wide, so K-quant recipes fall back to other types for some tensors,
as in the real files), SmolLM3, Qwen3-MoE, Gemma 1/2/3, OLMo 2, OLMoE, GraniteMoE, gpt-oss,
Qwen1.5-MoE, ERNIE 4.5 MoE, LFM2 and LFM2-MoE, Granite 4.0-H, Qwen3.5 and Qwen3.5-MoE. Tensor
names and metadata are llama.cpp's; matrices are F16, norms and biases F32 (llama.cpp's
converter's types), weights N(0, 0.02), norms 1.

The tokenizer and chat template are the packaged SmolLM2 GGUF's, its vocabulary padded up to
the model's with `[PAD<i>]` tokens of type UNUSED (as llama.cpp's converter pads a vocabulary
that is smaller than the embedding): llama.cpp checks that the token list matches the embedding
rows, and tokenbus builds its tokenizer from the file. Prompts tokenize as SmolLM2's.

The file is written tensor by tensor (header first, then each tensor drawn and written), so
peak memory is the largest tensor (the 8B's 1 GB output matrix), not the model: the 8B's 16 GB
F16 file needs well under 4 GB. Default output: ~/.cache/tokenbus/models/random-<config>-F16.gguf.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    ExpertGatingFuncType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
)
from gguf.constants import TokenType

from tokenbus.loader.source import packaged_smollm2_gguf

STD = 0.02  # transformers' initializer_range: activations stay finite through any depth
CHUNK_ROWS = 4096  # rows drawn at a time: float32 scratch of CHUNK_ROWS * cols values
GEMMA = ("gemma2", "gemma3")  # sandwich norms: post_attention_norm and post_ffw_norm too
POST_NORM_ONLY = ("olmo2",)  # post_attention_norm and post_ffw_norm, no attn_norm / ffn_norm
# gpt-oss: biases on q/k/v, attn_output, the router and the experts; a sink per query head; its
# pre-MLP norm named post_attention_norm
GPT_OSS = "gpt-oss"
ERNIE_MOE = "ernie4_5-moe"
LFM2_MOE = "lfm2moe"  # LFM2's layers, sigmoid-scored experts chosen with a bias
# Qwen3.5: Gated DeltaNet layers (attn_qkv, attn_gate, ssm_*) among gated attention layers
# (attn_q holds each head's queries and gate), post_attention_norm before each MLP
QWEN35 = "qwen35"
QWEN35_MOE = "qwen35moe"  # Qwen3.5's layers, every MLP experts and a gated shared expert
QWEN35_ARCHS = (QWEN35, QWEN35_MOE)


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # llama.cpp's general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    context: int
    rms_eps: float
    tied: bool
    qkv_bias: bool = False
    # Llama 3 rope scaling (factor, low_freq_factor, high_freq_factor, original context)
    llama3_rope: tuple[float, float, float, int] | None = None
    # Sparse MoE (qwen3moe): experts stacked per layer as ffn_{gate,up,down}_exps
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # a shared expert (ffn_*_shexp), 0: none
    dense_lead: int = 0  # ERNIE's leading dense layers before the MoE ones
    head_dim_override: int = 0  # Qwen3's head_dim != hidden / heads
    qk_norm: bool = False  # Qwen3's attn_q_norm / attn_k_norm
    # Gemma 3: the local layers' window (llama.cpp fixes the pattern, five local then a global,
    # and the local RoPE base, 10k); its sandwich norms (post_attention_norm, post_ffw_norm)
    # come with the architecture.
    sliding_window: int = 0
    # Gemma 2: soft-caps of the attention scores and of the final logits (its pattern: local and
    # global layers alternate; sandwich norms as Gemma 3's, no q/k norms)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    yarn: tuple[float, int] | None = None  # YaRN's factor and original context
    # LFM2: its gated short convolutions' layers (shortconv.*, no attention, head_count_kv 0
    # there) and their taps; the final norm named token_embd_norm
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    # Granite 4.0-H (granitehybrid): its Mamba2 layers (ssm_* tensors, head_count_kv 0 there),
    # their heads of ssm_head_dim, state size and B/C groups; conv_kernel is their conv's taps
    ssm_layers: tuple[int, ...] = ()
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    # Qwen3.5's Gated DeltaNet layers: key and value heads of delta_dim (conv_kernel taps)
    delta_layers: tuple[int, ...] = ()
    delta_k_heads: int = 0
    delta_v_heads: int = 0
    delta_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads


# The published models' config.json values.
CONFIGS = {
    "llama-3.2-1b": ModelShape(
        "llama", 2048, 16, 32, 8, 8192, 128256, 500000.0, 131072, 1e-5, True,
        llama3_rope=(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3.2-3b": ModelShape(
        "llama", 3072, 28, 24, 8, 8192, 128256, 500000.0, 131072, 1e-5, True,
        llama3_rope=(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3.1-8b": ModelShape(
        "llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, 1e-5, False,
        llama3_rope=(8.0, 1.0, 4.0, 8192),
    ),
    "smollm3-3b": ModelShape(
        "smollm3", 2048, 36, 16, 4, 11008, 128256, 5000000.0, 65536, 1e-6, True,
    ),
    "qwen2.5-0.5b": ModelShape(
        "qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, 32768, 1e-6, True, qkv_bias=True
    ),
    # Qwen3-30B-A3B's layer (2048 wide, 32/4 heads of 128, 128 experts of 768, top 8) at 8 of
    # its 48 layers: the whole model is ~61 GB at F16 and ~18 GB at Q4_K_M, past a 24 GiB box;
    # 8 layers keep every per-token kernel shape (the expert step, attention, the LM head) and
    # weigh ~11 GB at F16, ~3 GB at Q4_K_M.
    "qwen3-30b-a3b-8l": ModelShape(
        "qwen3moe", 2048, 8, 32, 4, 6144, 151936, 1000000.0, 40960, 1e-6, False,
        experts=128, experts_used=8, expert_intermediate=768, head_dim_override=128,
        qk_norm=True,
    ),
    # OLMo 2 1B (OLMo-2-0425-1B): 16 heads of 128 without GQA, q/k norms over the whole
    # projection ([2048] each), post-norms only, untied.
    "olmo-2-1b": ModelShape(
        "olmo2", 2048, 16, 16, 16, 8192, 100352, 500000.0, 4096, 1e-6, False, qk_norm=True,
    ),
    # OLMoE-1B-7B (OLMoE-1B-7B-0924): 64 experts of 1024, top 8, in every layer; q/k norms over
    # the whole projection, pre-norms; llama.cpp reads the experts' width as feed_forward_length.
    "olmoe-1b-7b": ModelShape(
        "olmoe", 2048, 16, 16, 16, 1024, 50304, 10000.0, 4096, 1e-5, False,
        experts=64, experts_used=8, expert_intermediate=1024, qk_norm=True,
    ),
    # Granite 3.0 3B-A800M: 1536 wide, 32 layers of 24 / 8 heads, 40 experts of 512 with 8 used
    # (3.3 B parameters, 0.8 B active), a 49k vocabulary, tied. Its multipliers stay 1 here: they
    # scale activations, not the work of a token.
    "granite-3b-a800m": ModelShape(
        "granitemoe", 1536, 32, 24, 8, 512, 49155, 10000.0, 4096, 1e-6, True,
        experts=40, experts_used=8, expert_intermediate=512,
    ),
    # gpt-oss-20b: 2880 wide, 64 / 8 heads of 64, 32 experts of 2880 with 4 used, a 201k
    # vocabulary, untied, windows of 128 on the even layers, YaRN 32 over 4096. The whole model
    # is 21 B parameters (42 GB at F16, past this disk's room beside the quantized copy); 8 of
    # its 24 layers keep every per-token kernel shape and weigh ~16 GB at F16, ~5 GB once
    # llama.cpp's MXFP4_MOE recipe makes the experts MXFP4 and the rest Q8_0, as the released
    # GGUF has them.
    "gpt-oss-20b-8l": ModelShape(
        GPT_OSS, 2880, 8, 64, 8, 2880, 201088, 150000.0, 131072, 1e-5, False, qkv_bias=True,
        experts=32, experts_used=4, expert_intermediate=2880, head_dim_override=64,
        sliding_window=128, yarn=(32.0, 4096),
    ),
    # Qwen1.5-MoE-A2.7B: 2048 wide, 16 heads of 128 without GQA, q/k/v biases, 60 experts of
    # 1408 with 4 used beside a shared expert of 5632, a 152k vocabulary, untied. The whole
    # model is 14.3 B parameters (29 GB at F16, past this disk's room beside its quantized copy);
    # 8 of its 24 layers keep every per-token kernel shape.
    "qwen1.5-moe-a2.7b-8l": ModelShape(
        "qwen2moe", 2048, 8, 16, 16, 5632, 151936, 1000000.0, 8192, 1e-6, False, qkv_bias=True,
        experts=60, experts_used=4, expert_intermediate=1408, shared_intermediate=5632,
    ),
    # ERNIE-4.5-21B-A3B: 2560 wide, 20 / 4 heads of 128, a dense first layer (12288), then 64
    # experts of 1536 with 6 used (chosen with a per-expert bias) beside an ungated shared MLP
    # of two experts' width, a 103k vocabulary, tied. The whole model is 21.8 B parameters (44
    # GB at F16); 8 of its 28 layers keep every per-token kernel shape.
    "ernie-4.5-21b-a3b-8l": ModelShape(
        "ernie4_5-moe", 2560, 8, 20, 4, 12288, 103424, 500000.0, 131072, 1e-5, True,
        experts=64, experts_used=6, expert_intermediate=1536, shared_intermediate=3072,
        head_dim_override=128, dense_lead=1,
    ),
    # Gemma 2B (gemma-2b): 2048 wide, 18 layers of 8 query heads of 256 over one KV head, GeGLU
    # of 16384, a 256k vocabulary tied to the LM head; Llama's two norms a layer.
    # LFM2-1.2B: 2048 wide, 16 layers, ten gated short convolutions of 3 taps and six
    # attention layers (32 / 8 heads of 64, per-head q/k norms), an MLP of 8192, a 65k
    # vocabulary, tied.
    "lfm2-1.2b": ModelShape(
        "lfm2", 2048, 16, 32, 8, 8192, 65536, 1000000.0, 128000, 1e-5, True, qk_norm=True,
        conv_layers=(0, 1, 3, 4, 6, 7, 9, 11, 13, 15), conv_kernel=3,
    ),
    # LFM2-8B-A1B: LFM2's layers 2048 wide (attention, 32 / 8 heads of 64, in 6 of its 24:
    # 2, 6, 10, 14, 18, 21), dense MLPs of 7168 in the first two, then 32 experts of 1792, top 4
    # (sigmoid scores, chosen with a bias), a 65k vocabulary, tied; 8.3 B parameters, 1.5 B
    # active. Its first 8 layers here (attention in 2 and 6).
    "lfm2-8b-a1b-8l": ModelShape(
        "lfm2moe", 2048, 8, 32, 8, 7168, 65536, 1000000.0, 128000, 1e-5, True, qk_norm=True,
        conv_layers=(0, 1, 3, 4, 5, 7), conv_kernel=3, experts=32, experts_used=4,
        expert_intermediate=1792, dense_lead=2,
    ),
    # Granite-4.0-H-1B: 1536 wide, 40 layers, 36 Mamba2 mixers (48 heads of 64, a state of 128,
    # one B/C group, 4 taps) and four attention layers (12 / 4 heads of 128, no rotary), a
    # shared MLP of 4096, a 100k vocabulary, tied.
    "granite-4.0-h-1b": ModelShape(
        "granitehybrid", 1536, 40, 12, 4, 4096, 100352, 10000.0, 131072, 1e-5, True,
        ssm_layers=tuple(i for i in range(40) if i not in (5, 15, 25, 35)), ssm_heads=48,
        ssm_head_dim=64, ssm_state=128, conv_kernel=4,
    ),
    # Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults): 4096 wide, 32 layers, three Gated
    # DeltaNet layers (16 key and 32 value heads of 128, 4 taps) to one gated attention layer
    # (16 / 4 heads of 256, a quarter of each turning), an MLP of 12288, a 248k vocabulary,
    # untied. Its first 8 layers here (attention in the fourth and eighth).
    "qwen3.5-9b-8l": ModelShape(
        QWEN35, 4096, 8, 16, 4, 12288, 248320, 10000000.0, 262144, 1e-6, False,
        head_dim_override=256, delta_layers=(0, 1, 2, 4, 5, 6), delta_k_heads=16,
        delta_v_heads=32, delta_dim=128, conv_kernel=4,
    ),
    # Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults): 2048 wide, 40 layers, Qwen3.5's
    # three Gated DeltaNet layers (16 key and 32 value heads of 128) to one gated attention layer
    # (16 / 2 heads of 256), every MLP 256 experts of 512 (8 a token) and a gated shared expert of
    # 512, a 248k vocabulary, untied: 34.7 B parameters. Its first 8 layers here.
    "qwen3.5-35b-a3b-8l": ModelShape(
        QWEN35_MOE, 2048, 8, 16, 2, 0, 248320, 10000000.0, 262144, 1e-6, False,
        head_dim_override=256, delta_layers=(0, 1, 2, 4, 5, 6), delta_k_heads=16,
        delta_v_heads=32, delta_dim=128, conv_kernel=4, experts=256, experts_used=8,
        expert_intermediate=512, shared_intermediate=512,
    ),
    "gemma-2b": ModelShape(
        "gemma", 2048, 18, 8, 1, 16384, 256000, 10000.0, 8192, 1e-6, True, head_dim_override=256,
    ),
    "gemma-2-2b": ModelShape(
        "gemma2", 2304, 26, 8, 4, 9216, 256000, 10000.0, 8192, 1e-6, True,
        head_dim_override=256, sliding_window=4096, attn_softcap=50.0, final_softcap=30.0,
    ),
    # Gemma 3 1B: 1152 wide (not a multiple of 256, so K-quant recipes fall back to other types
    # for some tensors, as in the real files), 4/1 heads of 256, a 262k vocabulary, tied.
    "gemma-3-1b": ModelShape(
        "gemma3", 1152, 26, 4, 1, 6912, 262144, 1000000.0, 32768, 1e-6, True,
        head_dim_override=256, qk_norm=True, sliding_window=512,
    ),
}  # fmt: skip


def default_out(config: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "tokenbus" / "models" / f"random-{config}-F16.gguf"


def llama3_rope_factors(shape: ModelShape) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf rope_freqs for rope_type llama3: a divisor per frequency."""
    factor, low, high, original = shape.llama3_rope
    dim = shape.head_dim
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_plan(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp name, numpy shape [out, in], kind) in llama.cpp's converter's order; kind:
    matrix (F16, random), norm (F32 ones: Gemma's stored 1 + w, so w = 0 there too), bias (F32
    random), rope (F32 factors), decay (Mamba2's A)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, h), "matrix"
    if shape.llama3_rope:
        yield "rope_freqs.weight", (shape.head_dim // 2,), "rope"
    oss = shape.architecture == GPT_OSS
    for i in range(shape.layers):
        b = f"blk.{i}."
        post_norms = shape.architecture in (*GEMMA, *POST_NORM_ONLY, GPT_OSS)
        pre_norms = shape.architecture not in POST_NORM_ONLY
        if pre_norms:
            yield b + "attn_norm.weight", (h,), "norm"
        if i in shape.ssm_layers:
            yield from _mamba2(b, shape)
            yield b + "ffn_norm.weight", (h,), "norm"
            yield from _mlp(b, shape, h, post_norms)
            continue
        if shape.architecture in QWEN35_ARCHS:
            yield from (
                _gated_delta_net(b, shape) if i in shape.delta_layers else _gated_attn(b, shape)
            )
            yield b + "post_attention_norm.weight", (h,), "norm"
            yield from _ffn(b, i, shape, h, post_norms)
            continue
        if i in shape.conv_layers:  # llama.cpp's lfm2: the conv [H, K] stays F32
            yield b + "shortconv.conv.weight", (h, shape.conv_kernel), "bias"
            yield b + "shortconv.in_proj.weight", (3 * h, h), "matrix"
            yield b + "shortconv.out_proj.weight", (h, h), "matrix"
            yield b + "ffn_norm.weight", (h,), "norm"
            yield from _ffn(b, i, shape, h, post_norms)
            continue
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield b + name + ".weight", (rows, h), "matrix"
            if shape.qkv_bias:
                yield b + name + ".bias", (rows,), "bias"
        if shape.qk_norm:  # OLMo 2's over the whole projection, the others' over a head
            whole = shape.architecture in ("olmo2", "olmoe")
            yield b + "attn_q_norm.weight", (q if whole else shape.head_dim,), "norm"
            yield b + "attn_k_norm.weight", (kv if whole else shape.head_dim,), "norm"
        yield b + "attn_output.weight", (h, q), "matrix"
        if oss:
            yield b + "attn_output.bias", (h,), "bias"
            yield b + "attn_sinks.weight", (shape.heads,), "bias"
        if post_norms:
            yield b + "post_attention_norm.weight", (h,), "norm"
        if pre_norms and not oss:
            yield b + "ffn_norm.weight", (h,), "norm"
        yield from _ffn(b, i, shape, h, post_norms)
    final_norm = "token_embd_norm" if shape.conv_layers else "output_norm"
    yield final_norm + ".weight", (h,), "norm"
    if not shape.tied:
        yield "output.weight", (shape.vocab, h), "matrix"


def _mamba2(b: str, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A Mamba2 mixer's tensors as llama.cpp's GraniteHybridModel writes them: in_proj (gate,
    xBC, dt), the conv [conv_dim, K] and its bias, dt's bias, A (negative: -1 .. -H, as HF
    initialises A_log) and D as [H, 1] (no .weight suffix), the gated norm [G, I / G], out_proj."""
    inner = shape.ssm_heads * shape.ssm_head_dim
    conv_dim = inner + 2 * shape.ssm_groups * shape.ssm_state
    yield b + "ssm_in.weight", (inner + conv_dim + shape.ssm_heads, shape.hidden), "matrix"
    yield b + "ssm_conv1d.weight", (conv_dim, shape.conv_kernel), "bias"
    yield b + "ssm_conv1d.bias", (conv_dim,), "bias"
    yield b + "ssm_dt.bias", (shape.ssm_heads,), "bias"
    yield b + "ssm_a", (shape.ssm_heads, 1), "decay"
    yield b + "ssm_d", (shape.ssm_heads, 1), "norm"
    yield b + "ssm_norm.weight", (shape.ssm_groups, inner // shape.ssm_groups), "norm"
    yield b + "ssm_out.weight", (shape.hidden, inner), "matrix"


def _gated_delta_net(b: str, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A Gated DeltaNet layer's tensors as llama.cpp's Qwen3_5TextModel writes them: q, k, v
    fused (attn_qkv), the gate z (attn_gate), b and a (ssm_beta, ssm_alpha), the conv [C, K],
    dt's bias, A (negative, no suffix), the output norm [dv], ssm_out."""
    keys, values = shape.delta_k_heads * shape.delta_dim, shape.delta_v_heads * shape.delta_dim
    heads, h = shape.delta_v_heads, shape.hidden
    yield b + "attn_qkv.weight", (2 * keys + values, h), "matrix"
    yield b + "attn_gate.weight", (values, h), "matrix"
    yield b + "ssm_conv1d.weight", (2 * keys + values, shape.conv_kernel), "bias"
    yield b + "ssm_dt.bias", (heads,), "bias"
    yield b + "ssm_a", (heads,), "decay"
    yield b + "ssm_beta.weight", (heads, h), "matrix"
    yield b + "ssm_alpha.weight", (heads, h), "matrix"
    yield b + "ssm_norm.weight", (shape.delta_dim,), "norm"
    yield b + "ssm_out.weight", (h, values), "matrix"


def _gated_attn(b: str, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Qwen3.5's attention: attn_q holds each head's queries then its gate; per-head q/k
    norms."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield b + "attn_q.weight", (2 * q, shape.hidden), "matrix"
    yield b + "attn_k.weight", (kv, shape.hidden), "matrix"
    yield b + "attn_v.weight", (kv, shape.hidden), "matrix"
    yield b + "attn_q_norm.weight", (shape.head_dim,), "norm"
    yield b + "attn_k_norm.weight", (shape.head_dim,), "norm"
    yield b + "attn_output.weight", (shape.hidden, q), "matrix"


def _ffn(
    b: str, i: int, shape: ModelShape, h: int, post_norms: bool
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Layer i's MLP tensors: its experts' past the leading dense layers, else a dense MLP's."""
    if shape.experts and i >= shape.dense_lead:
        return _moe(b, shape, h)
    return _mlp(b, shape, h, post_norms)


def _moe(b: str, shape: ModelShape, h: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A sparse MoE layer's tensors: the router, a selection bias (ERNIE's, LFM2-MoE's), the
    experts stacked, a shared expert."""
    oss = shape.architecture == GPT_OSS
    e, inter = shape.experts, shape.expert_intermediate
    yield b + "ffn_gate_inp.weight", (e, h), "router"
    if oss:
        yield b + "ffn_gate_inp.bias", (e,), "bias"
    if shape.architecture in (ERNIE_MOE, LFM2_MOE):  # its selection bias
        yield b + "exp_probs_b.bias", (e,), "bias"
    for name, rows, cols in (("gate", inter, h), ("up", inter, h), ("down", h, inter)):
        yield b + f"ffn_{name}_exps.weight", (e, rows, cols), "matrix"
        if oss:
            yield b + f"ffn_{name}_exps.bias", (e, rows), "bias"
    if shape.shared_intermediate:  # llama.cpp's qwen2moe: the gate a [hidden] vector
        s = shape.shared_intermediate
        if shape.architecture != ERNIE_MOE:  # ERNIE's shared MLP has no gate
            yield b + "ffn_gate_inp_shexp.weight", (h,), "bias"
        yield b + "ffn_gate_shexp.weight", (s, h), "matrix"
        yield b + "ffn_up_shexp.weight", (s, h), "matrix"
        yield b + "ffn_down_shexp.weight", (h, s), "matrix"


def _mlp(
    b: str, shape: ModelShape, h: int, post_norms: bool
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A dense layer's MLP tensors (its ffn_norm comes before them)."""
    yield b + "ffn_gate.weight", (shape.intermediate, h), "matrix"
    yield b + "ffn_up.weight", (shape.intermediate, h), "matrix"
    yield b + "ffn_down.weight", (h, shape.intermediate), "matrix"
    if post_norms:
        yield b + "post_ffw_norm.weight", (h,), "norm"


@functools.cache
def tokenizer_fields(source: Path) -> tuple[tuple[str, object, GGUFValueType, GGUFValueType], ...]:
    """(key, value, type, array item type) of the source GGUF's tokenizer.* keys (read once:
    GGUFReader takes seconds over a 49k-token vocabulary)."""
    fields = GGUFReader(source).fields.items()
    return tuple(
        (key, f.contents(), f.types[0], f.types[-1])
        for key, f in fields
        if key.startswith("tokenizer.")
    )


def copy_tokenizer(writer: GGUFWriter, source: Path, vocab: int) -> None:
    """The source GGUF's tokenizer.* keys, its token list padded to `vocab` with UNUSED
    [PAD<i>] tokens."""
    for key, value, vtype, item_type in tokenizer_fields(source):
        if key == "tokenizer.ggml.tokens":
            if len(value) > vocab:
                raise ValueError(f"vocab: {vocab} is smaller than {source.name}'s {len(value)}")
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(TokenType.UNUSED)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [-1000.0] * (vocab - len(value))
        sub_type = item_type if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub_type)


def write_header(writer: GGUFWriter, name: str, shape: ModelShape, tokenizer: Path) -> None:
    writer.add_type("model")
    writer.add_name(f"random {name}")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(shape.vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    if shape.intermediate:  # a model with experts alone writes none (qwen35moe)
        writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    recurrent = (*shape.conv_layers, *shape.ssm_layers)
    if recurrent:  # llama.cpp's LFM2Model, GraniteHybridModel: 0 KV heads marks such a layer
        kv_heads = [0 if i in recurrent else shape.kv_heads for i in range(shape.layers)]
        writer.add_head_count_kv(kv_heads)
    else:
        writer.add_head_count_kv(shape.kv_heads)
    if shape.conv_layers:
        writer.add_shortconv_l_cache(shape.conv_kernel)
    if shape.ssm_layers:
        writer.add_ssm_conv_kernel(shape.conv_kernel)
        writer.add_ssm_state_size(shape.ssm_state)
        writer.add_ssm_group_count(shape.ssm_groups)
        writer.add_ssm_inner_size(shape.ssm_heads * shape.ssm_head_dim)
        writer.add_ssm_time_step_rank(shape.ssm_heads)
        writer.add_rope_scaling_finetuned(False)  # Granite 4.0-H: no layer turns a rotary
    # Qwen3.5's rotary turns the first quarter of each head
    quarter = shape.architecture in QWEN35_ARCHS
    writer.add_rope_dimension_count(shape.head_dim // (4 if quarter else 1))
    if shape.head_dim_override:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)
    if shape.shared_intermediate:
        writer.add_expert_shared_feed_forward_length(shape.shared_intermediate)
    if shape.architecture in QWEN35_ARCHS:  # llama.cpp's Qwen3_5TextModel
        writer.add_ssm_conv_kernel(shape.conv_kernel)
        writer.add_ssm_state_size(shape.delta_dim)
        writer.add_ssm_group_count(shape.delta_k_heads)
        writer.add_ssm_time_step_rank(shape.delta_v_heads)
        writer.add_ssm_inner_size(shape.delta_v_heads * shape.delta_dim)
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if shape.architecture == LFM2_MOE:  # llama.cpp's LFM2MoeModel
        writer.add_leading_dense_block_count(shape.dense_lead)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if shape.architecture == ERNIE_MOE:  # llama.cpp's Ernie4_5MoeModel
        writer.add_leading_dense_block_count(shape.dense_lead)
        writer.add_interleave_moe_layer_step(1)
        writer.add_expert_shared_count(shape.shared_intermediate // shape.expert_intermediate)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    if shape.attn_softcap:
        writer.add_attn_logit_softcapping(shape.attn_softcap)
    if shape.final_softcap:
        writer.add_final_logit_softcapping(shape.final_softcap)
    if shape.architecture in ("granite", "granitemoe", "granitehybrid"):
        writer.add_logit_scale(1.0)  # llama.cpp requires it of Granite (the others are optional)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_quantization_version(2)
    copy_tokenizer(writer, tokenizer, shape.vocab)


def draw(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """A matrix (F16) or bias or router (F32: llama.cpp keeps routers F32) of N(0, STD)
    values, or a norm's ones (F32). A stacked expert tensor [E, out, in] is drawn as
    [E * out, in]."""
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    if kind == "decay":  # Mamba2's A: -1 .. -H, one a head (as HF initialises A_log)
        return -np.arange(1, shape[0] + 1, dtype=np.float32).reshape(shape)
    if len(shape) == 3:
        return draw(rng, (shape[0] * shape[1], shape[2]), kind).reshape(shape)
    if kind in ("bias", "router"):
        return (rng.standard_normal(shape, dtype=np.float32) * STD).astype(np.float32)
    out = np.empty(shape, dtype=np.float16)
    scratch = np.empty((min(CHUNK_ROWS, shape[0]), shape[1]), dtype=np.float32)
    for start in range(0, shape[0], CHUNK_ROWS):  # chunks: float32 scratch stays small
        part = scratch[: min(CHUNK_ROWS, shape[0] - start)]
        rng.standard_normal(dtype=np.float32, out=part)
        part *= STD
        out[start : start + len(part)] = part
    return out


def write_random_gguf(
    name: str, out: Path, seed: int = 0, shape: ModelShape | None = None, quiet: bool = False
) -> Path:
    """Write config `name` (or `shape`, for tests' small models) to `out`, via a temporary
    file renamed at the end (an interrupted run leaves no half-written GGUF)."""
    shape = shape or CONFIGS[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    writer = GGUFWriter(tmp, shape.architecture)
    write_header(writer, name, shape, packaged_smollm2_gguf())
    plan = list(tensor_plan(shape))
    for tensor_name, tensor_shape, kind in plan:
        dtype = np.float16 if kind == "matrix" else np.float32
        nbytes = int(np.prod(tensor_shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(tensor_name, tensor_shape, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i, (_, tensor_shape, kind) in enumerate(plan):
        rope = kind == "rope"
        writer.write_tensor_data(
            llama3_rope_factors(shape) if rope else draw(rng, tensor_shape, kind)
        )
        if not quiet and (i % 50 == 0 or i == len(plan) - 1):
            print(f"  {i + 1}/{len(plan)} tensors, {time.perf_counter() - start:.0f} s", flush=True)
    writer.close()
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path, default=None, help="default: " + str(default_out("X")))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = write_random_gguf(args.config, args.out or default_out(args.config), args.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
