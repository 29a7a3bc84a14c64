"""Decoder layers as decode_layer.c reads them (L2): which of a loaded model's layers it can
run, and each one's weights as native/decode_layer.py's structs.

A layer runs there when it is made of the parts decode_layer.c computes (model/decoder.py's
pre-norm and sandwich-norm layers with their attention, a gated or GeGLU MLP or a sparse MoE
block, or latent attention; Gemma 4's layers, with or without experts beside the MLP) and
every linear of it is on tiled GGUF shards. kernel_plan.py
builds the result once per plan.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from tokenbus.model.attention_backend import AttentionBackend
from tokenbus.model.decoder import (
    Attention,
    DecoderLayer,
    GatedMLP,
    GeGLUMLP,
    QKNorm,
    SandwichDecoderLayer,
)
from tokenbus.model.layers import FusedCpuOps, Linear, RMSNorm, TorchOps
from tokenbus.model.layers.quantized import QuantizedLinearKernel
from tokenbus.model.mla import LatentAttention
from tokenbus.model.moe import SparseMoeBlock
from tokenbus.model.native import NativeBuildError, QuantKernels
from tokenbus.model.native.decode_layer import DecodeLayers
from tokenbus.model.native.decode_layer_weights import (
    LayerWeights,
    LinearWeights,
    MlaWeights,
    MoeWeights,
    PerLayerInputWeights,
    ShardWeights,
)
from tokenbus.model.native.dense_rows import RowInvariantLinear
from tokenbus.model.weights import LAYER_NORM_NAMES

logger = logging.getLogger(__name__)


def build_decode_layers(
    model: nn.Module,
    ops: TorchOps,
    attention: AttentionBackend,
    quant: QuantKernels | None,
) -> DecodeLayers | None:
    """decode_layer.c over every layer of `model`, where each one can run there: fp32 on CPU
    with the fused ops and the native attention kernel, every linear on tiled GGUF shards, no
    TP, every layer made of the parts decode_layer.c computes; else None. A step runs there
    only where every KV group's attention is the native kernel's decode path
    (KernelPlan._decode_step)."""
    kernel = attention.kernel
    if kernel is None or not isinstance(ops, FusedCpuOps) or quant is None or model.tp.enabled:
        return None
    layers = [_layer_weights(layer) for layer in model.layers]
    if None in layers:
        return None
    try:
        return DecodeLayers(layers, quant, kernel, ops.fused)
    except NativeBuildError as exc:
        logger.warning("decode layers in C unavailable, torch runs them: %s", exc)
        return None


# The parts decode_layer.c computes, as they are: a subclass may compute something else (another
# norm, another activation), so only these exact types are taken, and attention subclasses that
# keep the shared forward (a family's configuration of it: model/gemma.py's GemmaAttention).
# A layer's norms are read as weight and eps: an fp32 model's RMSNorm (Gemma's (1 + w) is
# stored added; layers.Fp32RMSNorm is then a plain one).
_C_LAYERS = (DecoderLayer, SandwichDecoderLayer)
_C_MLPS = (GatedMLP, GeGLUMLP, SparseMoeBlock)


def _layer_weights(layer: nn.Module) -> LayerWeights | None:
    """A decoder layer as decode_layer.c reads it, or None where it cannot run there."""
    # Imported here: model/gemma4.py imports causal_lm.py, which imports this module's caller.
    from tokenbus.model.gemma4 import Gemma4Attention, Gemma4DecoderLayer

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer) is Gemma4DecoderLayer and type(attn) is Gemma4Attention:
        return _gemma4_layer_weights(layer)
    latent = type(attn) is LatentAttention
    shared_attention = (
        isinstance(attn, Attention)
        and type(attn).forward is Attention.forward
        and type(attn)._head_norms_ is Attention._head_norms_  # not Command R+'s LayerNorms
        and not attn.output_gate
        and attn.gate_proj is None
    )
    if type(layer) not in _C_LAYERS or type(mlp) not in _C_MLPS or not (latent or shared_attention):
        return None
    norms = [getattr(layer, name, None) for name in LAYER_NORM_NAMES]
    if not all(norm is None or isinstance(norm, RMSNorm) for norm in norms):
        return None  # decode_layer.c's norms are RMSNorms (PhiMoE's LayerNorms are not)
    if isinstance(mlp, SparseMoeBlock):
        moe, gate_up, down = _moe_weights(mlp), None, None
        if moe is None:
            return None
    else:
        moe, gate_up, down = None, _tiled_linear(mlp.gate_up_proj), _tiled_linear(mlp.down_proj)
        if gate_up is None or down is None:
            return None
    if latent:
        return _latent_layer_weights(layer, moe, gate_up, down)
    qkv, o = _tiled_linear(attn.qkv_proj), _tiled_linear(attn.o_proj)
    if qkv is None or o is None:
        return None
    # A sandwich layer's norm before the MLP is its pre-feedforward one (None in OLMo 2's); its
    # post-attention norm is applied to attention's output before the residual add.
    sandwich = isinstance(layer, SandwichDecoderLayer)
    pre_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
    return LayerWeights(
        qkv,
        o,
        gate_up,
        down,
        _norm_weight(layer.input_layernorm),
        _norm_weight(pre_mlp),
        layer.post_attention_layernorm.eps,
        attn.scale,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        _norm_weight(attn.q_norm),
        _norm_weight(attn.k_norm),
        qk_norm_whole=attn.qk_norm is QKNorm.WHOLE,
        qk_norm_after_rope=attn.qk_norm_after_rope,
        moe=moe,
        window=attn.sliding_window,
        softcap=attn.logit_softcap,
        sinks=attn.sinks,
        residual_scale=1.0 if sandwich else layer.residual_scale,
        post_attn_norm=layer.post_attention_layernorm.weight if sandwich else None,
        post_mlp_norm=layer.post_feedforward_layernorm.weight if sandwich else None,
        mlp_activation="silu" if moe is not None else mlp.activation,
        rope_table=attn.rope_table or 0,
    )


def _gemma4_layer_weights(layer: nn.Module) -> LayerWeights | None:
    """Gemma 4's layer (model/gemma4.py): a sandwich block whose attention norms its values
    (or takes them from the keys' projection, or reads another layer's K/V), the 26B-A4B's
    experts beside its MLP, then the per-layer input joined and the whole output scaled."""
    from tokenbus.model.gemma4 import EXPERT_NORMS  # here: see _layer_weights

    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not GeGLUMLP:
        return None
    moe, experts_norms = None, None
    if layer.experts is not None:
        moe = _gemma4_experts(layer.experts)
        if moe is None:
            return None
        experts_norms = tuple(getattr(layer, name).weight for name in EXPERT_NORMS)
    linears = [_tiled_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj)]
    linears.append(_tiled_linear(mlp.down_proj))
    joins = None
    if layer.joins_per_layer_input:
        gate = _tiled_linear(layer.per_layer_input_gate)
        proj = _tiled_linear(layer.per_layer_projection)
        if gate is None or proj is None:
            return None
        joins = PerLayerInputWeights(gate, proj, layer.post_per_layer_input_norm.weight)
    if None in linears:
        return None
    qkv, o, gate_up, down = linears
    reader = attn.owner is not None
    return LayerWeights(
        qkv,
        o,
        gate_up,
        down,
        layer.input_layernorm.weight,
        layer.pre_feedforward_layernorm.weight,
        layer.post_attention_layernorm.eps,
        attn.scale,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.q_norm.weight,
        None if reader else attn.k_norm.weight,
        window=attn.sliding_window,
        post_attn_norm=layer.post_attention_layernorm.weight,
        post_mlp_norm=layer.post_feedforward_layernorm.weight,
        mlp_activation=mlp.activation,
        rope_table=attn.rope_table or 0,
        v_norm=None if reader else attn.v_norm_weight,
        k_eq_v=attn.k_eq_v,
        kv_reader=reader,
        per_layer_input=joins,
        layer_scalar=float(layer.layer_scalar),
        moe=moe,
        experts_norms=experts_norms,
    )


def _gemma4_experts(experts: SparseMoeBlock) -> MoeWeights | None:
    """Gemma 4's experts (gemma4.Gemma4Experts) as decode_layer.c runs them: tanh-GELU experts;
    the router's input normed without a weight, scaled per channel and by 1 / sqrt(hidden);
    softmax, the top k renormalised, each weight times its expert's scale."""
    moe = _moe_weights(experts)
    if moe is None:
        return None
    return dataclasses.replace(
        moe,
        norm_topk_prob=True,
        norm_eps=0.0,
        scale=1.0,
        selection_bias=None,
        sigmoid_scores=False,
        groups=1,
        topk_groups=1,
        router_in_scale=experts.router_scale.data,
        router_in_eps=experts.eps,
        router_in_mult=experts.root_size,
        expert_scale=experts.per_expert_scale.data,
    )


def _latent_layer_weights(
    layer: DecoderLayer,
    moe: MoeWeights | None,
    gate_up: LinearWeights | None,
    down: LinearWeights | None,
) -> LayerWeights | None:
    """A pre-norm layer with latent attention (model/mla.py) as decode_layer.c reads it: its
    projections on tiled shards, W_UK and W_UV fp32; or None."""
    attn: LatentAttention = layer.self_attn
    q_a = _tiled_linear(attn.q_a_proj) if attn.q_lora_rank else None
    q_b = _tiled_linear(attn.q_b_proj if attn.q_lora_rank else attn.q_proj)
    kv_a, o = _tiled_linear(attn.kv_a_proj_with_mqa), _tiled_linear(attn.o_proj)
    if None in (q_b, kv_a, o) or (attn.q_lora_rank and q_a is None):
        return None
    if attn.w_uk.dtype != torch.float32 or attn.tp.enabled:
        return None
    mla = MlaWeights(
        q_a,
        q_b,
        kv_a,
        attn.q_a_layernorm.weight if attn.q_lora_rank else None,
        attn.kv_a_layernorm.weight,
        attn.w_uk.data,
        attn.w_uv.data,
        attn.rope_dim,
        attn.interleaved,
        attn.kv_a_layernorm.eps,
    )
    return LayerWeights(
        LinearWeights([], kv_a.cols, None),  # no qkv: the latent's projections stand in
        o,
        gate_up,
        down,
        _norm_weight(layer.input_layernorm),
        _norm_weight(layer.post_attention_layernorm),
        layer.post_attention_layernorm.eps,
        attn.scale,
        attn.num_heads,
        1,
        attn.kv_lora_rank + attn.rope_dim,
        moe=moe,
        residual_scale=layer.residual_scale,
        mla=mla,
    )


def _norm_weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _moe_weights(block: SparseMoeBlock) -> MoeWeights | None:
    """An MoE MLP as decode_layer.c runs it: the router on dense_rows.c's panels, every expert's
    two linears on tiled shards, all experts on this rank (no expert parallelism), and a shared
    expert's two tiled linears with its gate on dense_rows.c's panels; or None."""
    router = block.gate.kernel
    if not isinstance(router, RowInvariantLinear) or block.tp.enabled:
        return None
    if block.sparsemixer_eps is not None:  # decode_layer.c routes by softmax or sigmoid only
        return None
    shared = None
    if block.shared_expert is not None:
        expert, gate = block.shared_expert, block.shared_expert_gate
        shared_linears = (_tiled_linear(expert.gate_up_proj), _tiled_linear(expert.down_proj))
        if None in shared_linears:
            return None
        if gate is not None and not isinstance(gate.kernel, RowInvariantLinear):
            return None
        shared = (*shared_linears, None if gate is None else gate.kernel.panels)
    gate_up = [_tiled_linear(expert.gate_up_proj) for expert in block.experts]
    down = [_tiled_linear(expert.down_proj) for expert in block.experts]
    if None in gate_up or None in down:
        return None
    limit, alpha = block.swiglu or (0.0, 1.0)
    return MoeWeights(
        router.panels,
        gate_up,
        down,
        block.top_k,
        block.norm_topk_prob,
        router_bias=router.bias,
        activation=block.activation,
        swiglu_limit=limit,
        swiglu_alpha=alpha,
        shared=shared,
        selection_bias=None if block.selection_bias is None else block.selection_bias.data,
        sigmoid_scores=block.sigmoid_scores,
        groups=block.groups,
        topk_groups=block.topk_groups,
        norm_eps=block.norm_eps,
        scale=block.routed_scaling_factor,
    )


def _tiled_linear(linear: Linear) -> LinearWeights | None:
    """A linear as decode_layer.c runs it (every GGUF shard tiled), or None."""
    kernel = linear.kernel
    if not isinstance(kernel, QuantizedLinearKernel) or not all(s.tiled for s in kernel.shards):
        return None
    shards = [ShardWeights(s.qtype, s.data, s.rows) for s in kernel.shards]
    return LinearWeights(shards, kernel.shards[0].cols, linear.bias, linear.lora)
