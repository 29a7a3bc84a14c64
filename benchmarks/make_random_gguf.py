"""Write a random-weight F16 GGUF of a real model's shape, for benchmarks at the sizes people run.

    .venv/bin/python benchmarks/make_random_gguf.py llama-3.2-1b [--out FILE] [--seed 0]
    benchmarks/peers/llama_cpp.sh quantize FILE.gguf FILE-Q4_K_M.gguf Q4_K_M   # then quantize

Configs (CONFIGS in random_gguf_shapes.py, most with a comment giving the real model's shape;
"-8l": its first 8 layers): Llama 3.x (rope factors as rope_freqs.weight, as llama.cpp's
converter writes them), Qwen2.5 (q/k/v biases; 896 wide, so K-quant recipes fall back to other
types for some tensors, as in the real files), SmolLM3, Qwen3-MoE, Gemma 1/2/3, OLMo 2, OLMoE,
GraniteMoE, gpt-oss, Qwen1.5-MoE, ERNIE 4.5 MoE, LFM2 and LFM2-MoE, Granite 4.0-H, Qwen3.5 and
Qwen3.5-MoE, GLM-4.5, MiniMax-M2, DeepSeek-V2. Tensor names and metadata are llama.cpp's;
matrices are F16, norms and biases F32 (llama.cpp's converter's types), weights N(0, 0.02),
norms 1.

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

from random_gguf_shapes import (  # benchmarks/ is sys.path[0] when run as a script
    CONFIGS,
    DEEPSEEK2,
    ERNIE_MOE,
    GEMMA,
    GEMMA3N,
    GEMMA3N_ALTUP,
    GEMMA3N_LAUREL,
    GEMMA4,
    GLM4_MOE,
    GPT_OSS,
    LFM2_MOE,
    MINIMAX_M2,
    POST_NORM_ONLY,
    QWEN35_ARCHS,
    ModelShape,
)
from tokenbus.loader.source import packaged_smollm2_gguf

STD = 0.02  # transformers' initializer_range: activations stay finite through any depth
CHUNK_ROWS = 4096  # rows drawn at a time: float32 scratch of CHUNK_ROWS * cols values


def default_out(config: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "tokenbus" / "models" / f"random-{config}-F16.gguf"


def rope_factors(shape: ModelShape) -> np.ndarray:
    """The rope_freqs tensor: Gemma 4's proportional rope (1 on the quarter of the global
    layers' angles that turn, 1e30 on the others, as its converter writes), else Llama 3's."""
    if shape.architecture != GEMMA4:
        return llama3_rope_factors(shape)
    half = shape.global_head_dim // 2
    return np.array([1.0] * (half // 4) + [1e30] * (half - half // 4), dtype=np.float32)


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
    if shape.architecture == GEMMA3N:
        yield from _gemma3n(shape)
        return
    if shape.architecture == GEMMA4:
        yield from _gemma4(shape)
        return
    yield "token_embd.weight", (shape.vocab, h), "matrix"
    if shape.llama3_rope:
        yield "rope_freqs.weight", (shape.head_dim // 2,), "rope"
    oss = shape.architecture == GPT_OSS
    for i in range(shape.layers):
        b = f"blk.{i}."
        post_norms = shape.architecture in (*GEMMA, *POST_NORM_ONLY, GPT_OSS)
        # gpt-oss and GLM-4.5 name their pre-MLP norm post_attention_norm
        renamed_ffn_norm = shape.architecture in (GPT_OSS, GLM4_MOE)
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
        if shape.kv_lora_rank:
            yield from _latent_attention(b, shape)
            yield b + "ffn_norm.weight", (h,), "norm"
            yield from _ffn(b, i, shape, h, post_norms)
            continue
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield b + name + ".weight", (rows, h), "matrix"
            if shape.qkv_bias:
                yield b + name + ".bias", (rows,), "bias"
        if shape.qk_norm:  # OLMo 2's over the whole projection, the others' over a head
            whole = shape.architecture in ("olmo2", "olmoe", MINIMAX_M2)
            yield b + "attn_q_norm.weight", (q if whole else shape.head_dim,), "norm"
            yield b + "attn_k_norm.weight", (kv if whole else shape.head_dim,), "norm"
        yield b + "attn_output.weight", (h, q), "matrix"
        if oss:
            yield b + "attn_output.bias", (h,), "bias"
            yield b + "attn_sinks.weight", (shape.heads,), "bias"
        if post_norms or renamed_ffn_norm:
            yield b + "post_attention_norm.weight", (h,), "norm"
        if pre_norms and not renamed_ffn_norm:
            yield b + "ffn_norm.weight", (h,), "norm"
        yield from _ffn(b, i, shape, h, post_norms)
    final_norm = "token_embd_norm" if shape.conv_layers else "output_norm"
    yield final_norm + ".weight", (h,), "norm"
    if not shape.tied:
        yield "output.weight", (shape.vocab, h), "matrix"


def _gemma3n(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """llama.cpp's Gemma3NModel's tensors: the per-layer table and projection, the AltUp
    projections stacked [3, H, H], and each layer's attention (q/k norms), sandwich norms, MLP,
    per-layer gate and projection, AltUp coefficients and router (F32, as the converter's small
    tensors), LAuReL."""
    h, p, n = shape.hidden, shape.per_layer_input, GEMMA3N_ALTUP
    q, kv, d = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.head_dim
    yield "token_embd.weight", (shape.vocab, h), "matrix"
    yield "per_layer_token_embd.weight", (shape.vocab, shape.layers * p), "matrix"
    yield "per_layer_model_proj.weight", (shape.layers * p, h), "matrix"
    yield "per_layer_proj_norm.weight", (p,), "norm"
    yield "altup_proj.weight", (n - 1, h, h), "matrix"
    yield "altup_unembd_proj.weight", (n - 1, h, h), "matrix"
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), "norm"
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield b + name + ".weight", (rows, h), "matrix"
        yield b + "attn_q_norm.weight", (d,), "norm"
        yield b + "attn_k_norm.weight", (d,), "norm"
        yield b + "attn_output.weight", (h, q), "matrix"
        yield b + "post_attention_norm.weight", (h,), "norm"
        yield b + "ffn_norm.weight", (h,), "norm"
        yield from _mlp(b, shape, h, post_norms=True)
        yield b + "inp_gate.weight", (p, h), "matrix"
        yield b + "proj.weight", (h, p), "matrix"
        yield b + "post_norm.weight", (h,), "norm"
        yield b + "altup_correct_coef.weight", (n, n), "router"
        yield b + "altup_correct_scale.weight", (h,), "norm"
        yield b + "altup_predict_coef.weight", (n * n, n), "router"
        yield b + "altup_router.weight", (n, h), "router"
        yield b + "altup_router_norm.weight", (h,), "norm"
        yield b + "laurel_l.weight", (GEMMA3N_LAUREL, h), "matrix"
        yield b + "laurel_r.weight", (h, GEMMA3N_LAUREL), "matrix"
        yield b + "laurel_post_norm.weight", (h,), "norm"
    yield "output_norm.weight", (h,), "norm"


def _gemma4(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """llama.cpp's Gemma4Model's tensors: the per-layer table and projection, the global
    layers' rope_freqs, and each layer's attention of its kind's shape (q/k norms), sandwich
    norms, MLP, per-layer gate and projection, output scale."""
    h, p = shape.hidden, shape.per_layer_input
    yield "token_embd.weight", (shape.vocab, h), "matrix"
    yield "per_layer_token_embd.weight", (shape.vocab, shape.layers * p), "matrix"
    yield "per_layer_model_proj.weight", (shape.layers * p, h), "matrix"
    yield "per_layer_proj_norm.weight", (p,), "norm"
    yield "rope_freqs.weight", (shape.global_head_dim // 2,), "rope"
    for i in range(shape.layers):
        b, local = f"blk.{i}.", _gemma4_local(i)
        d = shape.head_dim if local else shape.global_head_dim
        kv = (shape.kv_heads if local else shape.global_kv_heads) * d
        yield b + "attn_norm.weight", (h,), "norm"
        for name, rows in (("attn_q", shape.heads * d), ("attn_k", kv), ("attn_v", kv)):
            yield b + name + ".weight", (rows, h), "matrix"
        yield b + "attn_q_norm.weight", (d,), "norm"
        yield b + "attn_k_norm.weight", (d,), "norm"
        yield b + "attn_output.weight", (h, shape.heads * d), "matrix"
        yield b + "post_attention_norm.weight", (h,), "norm"
        yield b + "ffn_norm.weight", (h,), "norm"
        yield from _mlp(b, shape, h, post_norms=True)
        yield b + "inp_gate.weight", (p, h), "matrix"
        yield b + "proj.weight", (h, p), "matrix"
        yield b + "post_norm.weight", (h,), "norm"
        yield b + "layer_output_scale.weight", (1,), "norm"
    yield "output_norm.weight", (h,), "norm"


def _gemma4_local(layer: int) -> bool:
    return (layer + 1) % 6 != 0  # five local layers, then a global one


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


def _latent_attention(b: str, shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """DeepseekV2Model's attention tensors: the queries (through a bottleneck where q_lora_rank
    is set), the latent and the shared turned key, kv_b_proj split per head into attn_k_b
    [H, c, nope] and attn_v_b [H, v, c], the output."""
    h, heads, c = shape.hidden, shape.heads, shape.kv_lora_rank
    q = heads * (shape.qk_nope_dim + shape.qk_rope_dim)
    if shape.q_lora_rank:
        yield b + "attn_q_a.weight", (shape.q_lora_rank, h), "matrix"
        yield b + "attn_q_a_norm.weight", (shape.q_lora_rank,), "norm"
        yield b + "attn_q_b.weight", (q, shape.q_lora_rank), "matrix"
    else:
        yield b + "attn_q.weight", (q, h), "matrix"
    yield b + "attn_kv_a_mqa.weight", (c + shape.qk_rope_dim, h), "matrix"
    yield b + "attn_kv_a_norm.weight", (c,), "norm"
    yield b + "attn_k_b.weight", (heads, c, shape.qk_nope_dim), "matrix"
    yield b + "attn_v_b.weight", (heads, shape.v_head_dim, c), "matrix"
    yield b + "attn_output.weight", (h, heads * shape.v_head_dim), "matrix"


def _ffn(
    b: str, i: int, shape: ModelShape, h: int, post_norms: bool
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Layer i's MLP tensors: its experts' past the leading dense layers, else a dense MLP's."""
    if shape.experts and i >= shape.dense_lead:
        return _moe(b, shape, h)
    return _mlp(b, shape, h, post_norms)


def _moe(b: str, shape: ModelShape, h: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A sparse MoE layer's tensors: the router, a selection bias (ERNIE's, LFM2-MoE's,
    GLM-4.5's, MiniMax-M2's), the experts stacked, a shared expert."""
    oss = shape.architecture == GPT_OSS
    e, inter = shape.experts, shape.expert_intermediate
    yield b + "ffn_gate_inp.weight", (e, h), "router"
    if oss:
        yield b + "ffn_gate_inp.bias", (e,), "bias"
    if shape.architecture in (ERNIE_MOE, LFM2_MOE, GLM4_MOE, MINIMAX_M2):  # its selection bias
        yield b + "exp_probs_b.bias", (e,), "bias"
    for name, rows, cols in (("gate", inter, h), ("up", inter, h), ("down", h, inter)):
        yield b + f"ffn_{name}_exps.weight", (e, rows, cols), "matrix"
        if oss:
            yield b + f"ffn_{name}_exps.bias", (e, rows), "bias"
    if shape.shared_intermediate:  # llama.cpp's qwen2moe: the gate a [hidden] vector
        s = shape.shared_intermediate
        if shape.architecture not in (ERNIE_MOE, GLM4_MOE, DEEPSEEK2):  # ungated shared MLPs
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
    elif shape.architecture == GEMMA4 and shape.global_kv_heads != shape.kv_heads:
        local = map(_gemma4_local, range(shape.layers))
        writer.add_head_count_kv(
            [shape.kv_heads if is_local else shape.global_kv_heads for is_local in local]
        )
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
    # Qwen3.5's rotary turns the first quarter of each head, GLM-4.5's and MiniMax-M2's the
    # first half
    turning = {**dict.fromkeys(QWEN35_ARCHS, 4), GLM4_MOE: 2, MINIMAX_M2: 2}.get(
        shape.architecture, 1
    )
    turned = shape.global_head_dim or shape.qk_rope_dim or shape.head_dim // turning
    writer.add_rope_dimension_count(turned)
    if shape.head_dim_override and shape.architecture != GEMMA4:  # its own: per kind
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.kv_lora_rank or shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)
    if shape.shared_intermediate and shape.architecture not in (GLM4_MOE, DEEPSEEK2):
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
    if shape.architecture == MINIMAX_M2:  # llama.cpp's MiniMaxM2Model
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if shape.architecture == GLM4_MOE:  # llama.cpp's Glm4MoeModel (no MTP layer here)
        writer.add_expert_shared_count(shape.shared_intermediate // shape.expert_intermediate)
        writer.add_leading_dense_block_count(shape.dense_lead)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(1.0)
        writer.add_expert_weights_norm(True)
    if shape.architecture == DEEPSEEK2:  # llama.cpp's DeepseekV2Model (V2's softmax router)
        _write_latent_attention_header(writer, shape)
    if shape.architecture == GEMMA3N:
        _write_gemma3n_header(writer, shape)
    if shape.architecture == GEMMA4:
        _write_gemma4_header(writer, shape)
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


def _write_latent_attention_header(writer: GGUFWriter, shape: ModelShape) -> None:
    """DeepseekV2Model.set_gguf_parameters' keys beyond the shared ones (a V2 router)."""
    writer.add_key_length_mla(shape.qk_nope_dim + shape.qk_rope_dim)
    writer.add_value_length_mla(shape.v_head_dim)
    if shape.q_lora_rank:
        writer.add_q_lora_rank(shape.q_lora_rank)
    writer.add_kv_lora_rank(shape.kv_lora_rank)
    writer.add_leading_dense_block_count(shape.dense_lead)
    writer.add_expert_shared_count(shape.shared_intermediate // shape.expert_intermediate)
    writer.add_expert_weights_scale(1.0)
    writer.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
    writer.add_rope_scaling_yarn_log_mul(0.1 * 0.707)  # 0.1 x mscale_all_dim


def _write_gemma3n_header(writer: GGUFWriter, shape: ModelShape) -> None:
    """Gemma3NModel.set_gguf_parameters' keys beyond the shared ones."""
    local = [i % 5 != 4 for i in range(shape.layers)]  # four local layers, then a global one
    sparse = 1.6448536  # the 0.95 quantile of a normal
    writer.add_sliding_window_pattern(local)
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_altup_active_idx(0)
    writer.add_altup_num_inputs(GEMMA3N_ALTUP)
    writer.add_embedding_length_per_layer_input(shape.per_layer_input)
    writer.add_shared_kv_layers(shape.kv_shared)
    scales = [sparse] * shape.sparse_layers + [-math.inf] * (shape.layers - shape.sparse_layers)
    writer.add_activation_sparsity_scale(scales)


def _write_gemma4_header(writer: GGUFWriter, shape: ModelShape) -> None:
    """Gemma4Model.set_gguf_parameters' keys beyond the shared ones: each kind's head size."""
    local = [_gemma4_local(i) for i in range(shape.layers)]
    writer.add_sliding_window_pattern(local)
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_embedding_length_per_layer_input(shape.per_layer_input)
    writer.add_shared_kv_layers(shape.kv_shared)
    writer.add_key_length(shape.global_head_dim)
    writer.add_value_length(shape.global_head_dim)
    writer.add_key_length_swa(shape.head_dim)
    writer.add_value_length_swa(shape.head_dim)
    writer.add_rope_dimension_count_swa(shape.head_dim)


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
        writer.write_tensor_data(rope_factors(shape) if rope else draw(rng, tensor_shape, kind))
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
