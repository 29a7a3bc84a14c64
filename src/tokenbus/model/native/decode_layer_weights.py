"""A decoder layer's weights as decode_layer.c reads them: the frozen dataclasses a model's
layers are described by (c_layers.py builds them), and the ctypes structs they pack into,
which mirror kernels.h's `shard`, `linear`, `moe`, `mla` and `layer` field for field."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenbus.model.lora import LinearLoRA
from tokenbus.model.sdpa import check_sinks

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# The gated MLP activations decode_layer.c computes (kernels.h's MLP_*), by hidden_act (and
# gpt-oss's experts' clamped SwiGLU, moe.py's SparseMoeBlock.activation).
MLP_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "clamped_swiglu": 2}


class _Shard(ctypes.Structure):
    _fields_ = [("qtype", _I64), ("tiles", _PTR), ("rows", _I64)]


class _Linear(ctypes.Structure):
    # Pointer fields, not addresses: a ctypes array assigned to one is kept alive by the struct.
    _fields_ = [
        ("shards", ctypes.POINTER(_Shard)),
        ("num_shards", _I64),
        ("rows", _I64),
        ("cols", _I64),
        ("bias", _PTR),
        ("lora_a", _PTR),
        ("lora_b", _PTR),
        ("lora_width", _I64),
    ]


class _Moe(ctypes.Structure):
    _fields_ = [
        ("router", _PTR),
        ("router_bias", _PTR),
        ("selection_bias", _PTR),
        ("gate_up", ctypes.POINTER(_Linear)),
        ("down", ctypes.POINTER(_Linear)),
        ("num_experts", _I64),
        ("top_k", _I64),
        ("norm_topk_prob", _I64),
        ("activation", _I64),
        ("swiglu_limit", _F32),
        ("swiglu_alpha", _F32),
        ("shared_gate_up", ctypes.POINTER(_Linear)),
        ("shared_down", ctypes.POINTER(_Linear)),
        ("shared_gate", _PTR),
        ("shared_intermediate", _I64),
        ("sigmoid_scores", _I64),
        ("groups", _I64),
        ("topk_groups", _I64),
        ("norm_eps", _F32),
        ("scale", _F32),
        ("router_in_scale", _PTR),
        ("router_in_eps", _F32),
        ("router_in_mult", _F32),
        ("expert_scale", _PTR),
    ]


class _Mla(ctypes.Structure):
    _fields_ = [
        ("q_a", _Linear),
        ("q_b", _Linear),
        ("kv_a", _Linear),
        ("q_a_norm", _PTR),
        ("kv_a_norm", _PTR),
        ("w_uk", _PTR),
        ("w_uv", _PTR),
        ("q_lora_rank", _I64),
        ("kv_lora_rank", _I64),
        ("nope_dim", _I64),
        ("rope_dim", _I64),
        ("v_head_dim", _I64),
        ("interleaved", _I64),
        ("latent_eps", _F32),
    ]


class _PerLayerInput(ctypes.Structure):
    _fields_ = [("gate", _Linear), ("proj", _Linear), ("norm", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("post_attn_norm", _PTR),
        ("post_mlp_norm", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("qk_norm_whole", _I64),
        ("qk_norm_after_rope", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("hidden", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("window", _I64),
        ("softcap", _F32),
        ("sinks", _PTR),
        ("residual_scale", _F32),
        ("mlp_act", _I64),
        ("rope_table", _I64),
        ("moe", ctypes.POINTER(_Moe)),
        ("mla", ctypes.POINTER(_Mla)),
        ("v_norm", _PTR),
        ("k_eq_v", _I64),
        ("kv_reader", _I64),
        ("per_layer_input", ctypes.POINTER(_PerLayerInput)),
        ("whole_output", _I64),
        ("layer_scalar", _F32),
        ("mlp_out_norm", _PTR),
        ("experts_in_norm", _PTR),
        ("experts_out_norm", _PTR),
    ]


@dataclass(frozen=True)
class ShardWeights:
    """`rows` outputs of a linear in one tiled GGUF type."""

    qtype: int
    tiles: torch.Tensor
    rows: int


@dataclass(frozen=True)
class LinearWeights:
    """One linear as decode_layer.c reads it: its tiled shards (outputs side by side), an
    optional fp32 bias, optional LoRA slots (model/lora.LinearLoRA: written in place, so the
    pointers stay valid)."""

    shards: list[ShardWeights]
    cols: int
    bias: torch.Tensor | None
    lora: LinearLoRA | None = None

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def struct(self) -> _Linear:
        lora = self.lora
        shards = [_Shard(s.qtype, s.tiles.data_ptr(), s.rows) for s in self.shards]
        return _Linear(
            (_Shard * len(shards))(*shards),
            len(shards),
            self.rows,
            self.cols,
            None if self.bias is None else self.bias.data_ptr(),
            None if lora is None else lora.a.data_ptr(),
            None if lora is None else lora.b.data_ptr(),
            0 if lora is None else lora.width,
        )


@dataclass(frozen=True)
class MoeWeights:
    """A sparse MoE MLP as decode_layer.c reads it: the router's dense_rows.c panels (and its
    bias, fp32 [E]), and each expert's gate_up and down (on tiled shards, with their biases);
    `activation` a key of MLP_ACTIVATIONS, "silu", "clamped_swiglu" (with its limit, alpha) or
    "gelu_pytorch_tanh" (Gemma 4's experts).
    `shared`: a shared expert's gate_up and down and its gate's dense_rows.c panels [1, hidden]
    (Qwen2-MoE's; None: ungated, ERNIE's); None: none. `selection_bias`: fp32 [E] added to the
    probabilities to choose the top k (ERNIE's); None: none. The routing rule's other parts as
    SparseMoeBlock has them: sigmoid scores instead of a softmax, the choice within the best
    `topk_groups` of `groups` groups, the renormalising sum's epsilon and the weights' scale."""

    router: torch.Tensor
    gate_up: list[LinearWeights]
    down: list[LinearWeights]
    top_k: int
    norm_topk_prob: bool
    router_bias: torch.Tensor | None = None
    activation: str = "silu"
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    shared: tuple[LinearWeights, LinearWeights, torch.Tensor | None] | None = None
    selection_bias: torch.Tensor | None = None
    sigmoid_scores: bool = False
    groups: int = 1
    topk_groups: int = 1
    norm_eps: float = 0.0
    scale: float = 1.0
    # Gemma 4's router input: RMS-normed without a weight (eps), times this [hidden] per channel
    # and router_in_mult; None: the input as it is. expert_scale [E]: each chosen expert's
    # weight times its own, last; None: none.
    router_in_scale: torch.Tensor | None = None
    router_in_eps: float = 0.0
    router_in_mult: float = 1.0
    expert_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "clamped_swiglu", "gelu_pytorch_tanh"):
            raise ValueError(
                "an MoE MLP in C takes silu, clamped_swiglu or gelu_pytorch_tanh, "
                f"not {self.activation!r}"
            )
        experts = len(self.gate_up)
        for name in ("router_bias", "selection_bias", "expert_scale"):
            bias = getattr(self, name)
            if bias is not None and (
                bias.dtype != torch.float32
                or tuple(bias.shape) != (experts,)
                or not bias.is_contiguous()
            ):
                raise ValueError(
                    f"{name} must be contiguous fp32 [{experts}], "
                    f"got {bias.dtype} {list(bias.shape)}"
                )

    def struct(self) -> _Moe:
        experts = len(self.gate_up)
        shared_gate_up, shared_down, shared_gate = self.shared or (None, None, None)
        return _Moe(
            self.router.data_ptr(),
            None if self.router_bias is None else self.router_bias.data_ptr(),
            None if self.selection_bias is None else self.selection_bias.data_ptr(),
            (_Linear * experts)(*(linear.struct() for linear in self.gate_up)),
            (_Linear * experts)(*(linear.struct() for linear in self.down)),
            experts,
            self.top_k,
            int(self.norm_topk_prob),
            MLP_ACTIVATIONS[self.activation],
            self.swiglu_limit,
            self.swiglu_alpha,
            None if shared_gate_up is None else (_Linear * 1)(shared_gate_up.struct()),
            None if shared_down is None else (_Linear * 1)(shared_down.struct()),
            None if shared_gate is None else shared_gate.data_ptr(),
            0 if shared_down is None else shared_down.cols,
            int(self.sigmoid_scores),
            self.groups,
            self.topk_groups,
            self.norm_eps,
            self.scale,
            None if self.router_in_scale is None else self.router_in_scale.data_ptr(),
            self.router_in_eps,
            self.router_in_mult,
            None if self.expert_scale is None else self.expert_scale.data_ptr(),
        )


@dataclass(frozen=True)
class MlaWeights:
    """Multi-head latent attention as decode_layer.c reads it (model/mla.py's LatentAttention):
    q_a (None: no bottleneck) and q_b (then the whole q projection), kv_a, each on tiled shards;
    the latents' norm weights; W_UK [H, nope, c] and W_UV [H, v, c], contiguous fp32."""

    q_a: LinearWeights | None
    q_b: LinearWeights
    kv_a: LinearWeights
    q_a_norm: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    rope_dim: int
    interleaved: bool
    latent_eps: float

    def struct(self) -> _Mla:
        for name in ("w_uk", "w_uv"):
            weight = getattr(self, name)
            if weight.dtype != torch.float32 or not weight.is_contiguous():
                raise ValueError(f"decode_layer: {name} must be contiguous fp32")
        heads, nope, latent = self.w_uk.shape
        return _Mla(
            _Linear() if self.q_a is None else self.q_a.struct(),
            self.q_b.struct(),
            self.kv_a.struct(),
            None if self.q_a_norm is None else self.q_a_norm.data_ptr(),
            self.kv_a_norm.data_ptr(),
            self.w_uk.data_ptr(),
            self.w_uv.data_ptr(),
            0 if self.q_a is None else self.q_a.rows,
            latent,
            nope,
            self.rope_dim,
            self.w_uv.shape[1],
            int(self.interleaved),
            self.latent_eps,
        )


@dataclass(frozen=True)
class PerLayerInputWeights:
    """A per-layer input joined after the MLP (gemma3n.PerLayerInputLayer): its gate [P, hidden]
    and projection [hidden, P] on tiled shards, the joined input's norm [hidden]."""

    gate: LinearWeights
    proj: LinearWeights
    norm: torch.Tensor

    def struct(self) -> _PerLayerInput:
        return _PerLayerInput(self.gate.struct(), self.proj.struct(), self.norm.data_ptr())


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as decode_layer.c reads it: its MLP is gate_up and down, or moe, or
    both (Gemma 4's experts beside the MLP, with experts_norms)."""

    qkv: LinearWeights
    o: LinearWeights
    gate_up: LinearWeights | None
    down: LinearWeights | None
    # the norms before attention and before the MLP; None: none there (OLMo 2's layers)
    input_norm: torch.Tensor | None
    post_norm: torch.Tensor | None
    eps: float
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Qwen3's RMSNorm of each query / key head before the rotary, [head_dim] each; None: none.
    # qk_norm_whole: OLMo 2's instead, over each token's query / key heads at once, [H * D].
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_whole: bool = False
    qk_norm_after_rope: bool = False  # HunYuan's: the heads normed after the rotary
    moe: MoeWeights | None = None
    window: int | None = None  # a sliding window (decoder.Attention.sliding_window); None: all
    softcap: float | None = None  # the scores' soft-cap (decoder.Attention.logit_softcap)
    # [num_heads] fp32: each query head's attention sink (decoder.Attention.sinks); None: none
    sinks: torch.Tensor | None = None
    # each sublayer's output scaled before it joins the residual (decoder.DecoderLayer's)
    residual_scale: float = 1.0
    # Gemma's sandwich norms (decoder.SandwichDecoderLayer): after attention, after the MLP;
    # post_norm is then its pre-feedforward norm. None: a pre-norm layer.
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    mlp_activation: str = "silu"  # a key of MLP_ACTIVATIONS
    rope_table: int = 0  # the row of the step's stacked rotary tables (decoder.Attention's)
    # latent attention in place of qkv's (then without shards; head_dim the latent cache's)
    mla: MlaWeights | None = None
    # Gemma 4's: each value head RMS-normed ([head_dim]; None: none); qkv projecting q and k,
    # the values being the keys (k_eq_v); qkv projecting q only, the layer attending the K/V
    # another layer wrote to the same cache (kv_reader: no k_norm then)
    v_norm: torch.Tensor | None = None
    k_eq_v: bool = False
    kv_reader: bool = False
    per_layer_input: PerLayerInputWeights | None = None
    # a float: the layer's output is whole (the residual stream with the MLP's output and any
    # per-layer input joined), times this (Gemma 4's layer_scalar, read as the layers are built,
    # after the weights load); None: the two kept apart
    layer_scalar: float | None = None
    # Gemma 4's experts (moe) beside the MLP (gate_up, down): the norms of the MLP's output, of
    # the experts' input (from the residual stream) and of their output; None: one MLP
    experts_norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def struct(self) -> _Layer:
        if (self.q_norm is None) != (self.k_norm is None) and not self.kv_reader:
            raise ValueError("decode_layer: q_norm and k_norm come together")
        self._check_norm_sizes()
        self._check_projection()
        self._check_gemma4_parts()
        if self.per_layer_input is not None and self.layer_scalar is None:
            raise ValueError("decode_layer: a per-layer input is joined to a whole output")
        if self.sinks is not None:  # C reads them as num_heads contiguous fp32 values
            check_sinks(self.sinks, self.num_heads, torch.device("cpu"))
        both = self.moe is not None and self.down is not None
        if both != (self.experts_norms is not None) or (self.moe is None and self.down is None):
            raise ValueError(
                "decode_layer: a layer's MLP is gate_up and down, or moe, or both with the "
                "experts' norms"
            )
        down = self.down if self.down is not None else self.moe.down[0]
        mlp_out, experts_in, experts_out = self.experts_norms or (None, None, None)
        return _Layer(
            self.qkv.struct(),
            self.o.struct(),
            _Linear() if self.gate_up is None else self.gate_up.struct(),
            _Linear() if self.down is None else self.down.struct(),
            None if self.input_norm is None else self.input_norm.data_ptr(),
            None if self.post_norm is None else self.post_norm.data_ptr(),
            None if self.post_attn_norm is None else self.post_attn_norm.data_ptr(),
            None if self.post_mlp_norm is None else self.post_mlp_norm.data_ptr(),
            None if self.q_norm is None else self.q_norm.data_ptr(),
            None if self.k_norm is None else self.k_norm.data_ptr(),
            int(self.qk_norm_whole),
            int(self.qk_norm_after_rope),
            self.eps,
            self.scale,
            self.qkv.cols,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            down.cols,
            self.window or 0,
            self.softcap or 0.0,
            None if self.sinks is None else self.sinks.data_ptr(),
            self.residual_scale,
            MLP_ACTIVATIONS[self.mlp_activation],
            self.rope_table,
            None if self.moe is None else ctypes.pointer(self.moe.struct()),
            None if self.mla is None else ctypes.pointer(self.mla.struct()),
            None if self.v_norm is None else self.v_norm.data_ptr(),
            int(self.k_eq_v),
            int(self.kv_reader),
            None if self.per_layer_input is None else ctypes.pointer(self.per_layer_input.struct()),
            int(self.layer_scalar is not None),
            1.0 if self.layer_scalar is None else self.layer_scalar,
            None if mlp_out is None else mlp_out.data_ptr(),
            None if experts_in is None else experts_in.data_ptr(),
            None if experts_out is None else experts_out.data_ptr(),
        )

    def _check_gemma4_parts(self) -> None:
        """C reads the per-layer input's linears and norm, and the router's input scale, over
        the hidden width: refuse any other shape."""
        hidden, joins = self.qkv.cols, self.per_layer_input
        if joins is not None and (
            joins.gate.cols != hidden
            or joins.proj.rows != hidden
            or joins.proj.cols != joins.gate.rows
            or joins.norm.numel() != hidden
        ):
            raise ValueError(
                f"decode_layer: a per-layer input's gate [{joins.gate.rows}, {joins.gate.cols}], "
                f"projection [{joins.proj.rows}, {joins.proj.cols}] and norm "
                f"[{joins.norm.numel()}] do not fit a hidden size of {hidden}"
            )
        scale = None if self.moe is None else self.moe.router_in_scale
        if scale is not None and (
            scale.dtype != torch.float32 or not scale.is_contiguous() or scale.numel() != hidden
        ):
            raise ValueError(f"router_in_scale must be contiguous fp32 [{hidden}]")

    def _check_projection(self) -> None:
        """C spreads qkv's outputs into q, k and v heads: refuse a projection of another width."""
        if self.mla is not None:
            return
        if self.k_eq_v and self.kv_reader:
            raise ValueError("decode_layer: a layer reading another's K/V projects no keys")
        heads = self.num_heads
        if not self.kv_reader:
            heads += self.num_kv_heads * (1 if self.k_eq_v else 2)
        if self.qkv.rows != heads * self.head_dim:
            raise ValueError(
                f"decode_layer: qkv projects {self.qkv.rows} values, not {heads * self.head_dim}"
            )

    def _check_norm_sizes(self) -> None:
        """C reads each norm's weight over the width it norms: refuse any other size here."""
        hidden, d, whole = self.qkv.cols, self.head_dim, self.qk_norm_whole
        names = ("input_norm", "post_norm", "post_attn_norm", "post_mlp_norm")
        norms = [(name, getattr(self, name), hidden) for name in names]
        names = ("mlp_out_norm", "experts_in_norm", "experts_out_norm")
        norms += [(name, norm, hidden) for name, norm in zip(names, self.experts_norms or ())]
        norms += [("q_norm", self.q_norm, self.num_heads * d if whole else d)]
        norms += [("k_norm", self.k_norm, self.num_kv_heads * d if whole else d)]
        norms += [("v_norm", self.v_norm, d)]
        for name, weight, width in norms:
            if weight is not None and weight.numel() != width:
                raise ValueError(f"decode_layer: {name} has {weight.numel()} values, not {width}")
