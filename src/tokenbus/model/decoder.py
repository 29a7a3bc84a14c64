"""The parts of a decoder layer, shared by every family (L2): attention, a gated MLP (SiLU or
GeGLU), and the layers that join them (pre-norm; Gemma's sandwich norms; OLMo 2's post-norms,
a sandwich without its pre-norms). Each
calls one injected op for each step it takes: its linears' kernels (layers/linear.py), the
elementwise ops (`self.ops`: layers/ops.py) and the step's attention plan (ctx.attn_metadata:
model/attention.py). Which kernels those are, the kernel plan
decides once at load (model/kernel_plan.py); a family file only chooses the parts.

Token layout is flat: every tensor is [T, ...] over the step's tokens of all requests.
Fused weights: q/k/v are one `qkv_proj` [Hq*D + 2*Hkv*D, hidden] and gate/up one
`gate_up_proj` [2*I, hidden]. Under tensor parallelism (model/parallel.py) each rank builds the
same modules at its shard's sizes and joins partial results with one all-reduce after o_proj
and one after down_proj.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from tokenbus.model.attention import Plan, paged_attention
from tokenbus.model.layers import Linear, OpsModule, RMSNorm
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model_arch import ModelArch


class QKNorm(enum.Enum):
    """Which RMSNorm q and k take before the rotary."""

    NONE = "none"
    HEADS = "heads"  # each head over its D values, one weight [D] (Qwen3's, Gemma 3's)
    WHOLE = "whole"  # each token's projection at once, a weight [H * D] (OLMo 2's)


class Attention(OpsModule):
    """qkv_proj -> (q/k RMSNorm) -> rotary -> paged attention -> o_proj.

    `qkv_bias` / `o_bias`: which projections carry a bias; `qk_norm`: q_norm / k_norm before
    the rotary, over each head (QKNorm.HEADS: a weight [D] each, whole on every rank) or over
    all of a token's query (key) heads at once (QKNorm.WHOLE: a weight [Hq * D] / [Hkv * D],
    this rank's heads' part of it; the mean square is summed over the ranks), each a `norm`
    (the family's RMSNorm). `sliding_window`: each query sees only its last `sliding_window`
    keys (itself included); None: all. CausalLM gives each layer ModelArch.sliding_windows'.
    `rope_table`: a model with a RoPE table per kind of layer (Gemma 3's and OLMo 3's local
    layers: CausalLM's local table; SmolLM3's NoPE ones) hands its layers the tables stacked
    [R, T, 1, D/2], and this layer reads row `rope_table`; None: one table [T, 1, D/2].
    `output_gate` (arch.attn_output_gate, Qwen3.5's): qkv_proj projects a gate per query
    channel too (a fourth shard, `gate_proj`), and the heads' output is scaled by its sigmoid
    before o_proj; with arch.attn_head_gate (LFM3's) `gate_proj` [Hq, hidden], a linear of its
    own (unbiased whatever q/k/v are), gives one gate a query head, scaling all of that head's
    output. `qk_norm_after_rope` (a family sets it: HunYuan's): the QKNorm.HEADS norms come
    after the rotary instead of before it.

    A family's subclass only configures these (model/gemma.py's: scale, soft-cap, norms); the
    computation is this forward, which decode_layer.c mirrors
    (model/c_layers.py takes a subclass there only while it keeps this forward)."""

    def __init__(
        self,
        arch: ModelArch,
        tp: TensorParallel = SINGLE,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: QKNorm = QKNorm.NONE,
        sliding_window: int | None = None,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.qk_norm = qk_norm
        self.output_gate = arch.attn_output_gate
        self.sliding_window = sliding_window
        local = tp.shard_arch(arch)
        self.num_heads = local.num_attention_heads
        self.num_kv_heads = local.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        gate = (q_size,) if self.output_gate else ()
        self.qkv_proj = Linear(arch.hidden_size, (q_size, kv_size, kv_size, *gate), bias=qkv_bias)
        self.o_proj = Linear(q_size, (arch.hidden_size,), bias=o_bias)
        self.gate_proj = (
            Linear(arch.hidden_size, (self.num_heads,)) if arch.attn_head_gate else None
        )
        self.q_norm = self.k_norm = None
        if qk_norm is not QKNorm.NONE:
            whole = qk_norm is QKNorm.WHOLE
            self.q_norm = norm(q_size if whole else arch.head_dim, arch.rms_norm_eps)
            self.k_norm = norm(kv_size if whole else arch.head_dim, arch.rms_norm_eps)
        self.qk_norm_after_rope = False
        self.logit_softcap: float | None = None  # a family's scores soft-cap (model/gemma.py)
        # A family's attention sinks (model/gpt_oss.py): [this rank's query heads] fp32, one
        # logit per head joining its softmax's denominator with no value; None: none.
        self.sinks: torch.Tensor | None = None
        self.rope_table: int | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`q_scale` [T, 1, 1]: each token's query scale after the rotary (CausalLM.query_scale);
        None: none."""
        num_tokens = x.shape[0]
        if self.rope_table is not None:
            cos, sin = cos[self.rope_table], sin[self.rope_table]
        qkv, gate = self.qkv_proj(x), None
        if self.output_gate:  # [q, k, v | gate]: q, k and v go on as one fresh tensor
            width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            qkv, gate = qkv[:, :width].contiguous(), qkv[:, width:]
        qkv = qkv.view(num_tokens, -1, self.head_dim)  # [T, Hq + 2 Hkv, D], fresh
        heads_normed = self.qk_norm is QKNorm.HEADS
        if heads_normed and not self.qk_norm_after_rope:
            self._head_norms_(qkv, qkv[:, self.num_heads :])
        elif self.qk_norm is QKNorm.WHOLE:
            flat, q_size = qkv.view(num_tokens, -1), self.num_heads * self.head_dim
            self._whole_norm_(flat, 0, q_size, self.q_norm)
            self._whole_norm_(flat, q_size, self.num_kv_heads * self.head_dim, self.k_norm)
        q, k, v = self.ops.rope(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        if heads_normed and self.qk_norm_after_rope:
            self._head_norms_(q, k)
        if q_scale is not None:
            q.mul_(q_scale)  # q is a view of this call's fresh qkv
        out = paged_attention(
            q,
            k,
            v,
            kv_cache,
            slot_mapping,
            plan,
            self.scale,
            self.sliding_window,
            self.logit_softcap,
            self.sinks,
        )  # [T, Hq, D]
        if self.gate_proj is not None:  # one gate a head: [T, Hq, D] * [T, Hq, 1]
            out = out * torch.sigmoid(self.gate_proj(x)).unsqueeze(-1)
        out = out.view(num_tokens, self.num_heads * self.head_dim)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        # Row-parallel: each rank's heads give a partial sum (o_proj's bias lives on rank 0 only).
        return self.tp.all_reduce(self.o_proj(out))

    def _head_norms_(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q_norm over each of q's first num_heads heads and k_norm over each of k's first
        num_kv_heads, in place ([T, H, D] each: views of the step's qkv, or the rotary's)."""
        self.ops.head_rms_norm_(q, 0, self.num_heads, self.q_norm.weight, self.q_norm.eps)
        self.ops.head_rms_norm_(k, 0, self.num_kv_heads, self.k_norm.weight, self.k_norm.eps)

    def _whole_norm_(self, flat: torch.Tensor, start: int, width: int, norm: RMSNorm) -> None:
        """RMSNorm of columns [start, start + width) of flat [T, N], in place, over the whole
        projection: under TP this rank holds `width` of its columns, and every rank the same
        number (KV heads replicated evenly), so the mean square is the ranks' summed squares
        over size * width."""
        if not self.tp.enabled:
            self.ops.rms_norm_columns_(flat, start, width, norm.weight, norm.eps)
            return
        columns = flat[:, start : start + width]
        x = columns.to(norm.weight.dtype)
        mean_square = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / (width * self.tp.size)
        columns.copy_(x * torch.rsqrt(mean_square + norm.eps) * norm.weight)


class GatedMLP(OpsModule):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up as one linear."""

    activation = "silu"  # the hidden_act this part computes (`act_mul`)

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if arch.hidden_act != self.activation:
            raise ValueError(
                f"hidden_act: only {self.activation!r} is supported, got {arch.hidden_act!r}"
            )
        self.tp = tp
        size = tp.shard_arch(arch).intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, (size, size))
        self.down_proj = Linear(size, (arch.hidden_size,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        return self.tp.all_reduce(self.down_proj(self.act_mul(gate_up)))

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)


class GeGLUMLP(GatedMLP):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)) (Gemma's)."""

    activation = "gelu_pytorch_tanh"

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_mul(gate_up)


class ReluSquaredMLP(OpsModule):
    """down_proj(relu(up_proj(x)) ** 2), no gate (Nemotron-H's)."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        size = tp.shard_arch(arch).intermediate_size
        self.up_proj = Linear(arch.hidden_size, (size,))
        self.down_proj = Linear(size, (arch.hidden_size,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(torch.relu(self.up_proj(x)).square()))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), the residual carried apart.
    `residual_scale` (Granite's residual_multiplier; 1 elsewhere) scales each sublayer's output
    before it joins the residual. `norm` builds its norms (the family's RMSNorm)."""

    def __init__(
        self,
        arch: ModelArch,
        self_attn: Attention | None,
        mlp: GatedMLP,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn  # None: another mixer (RecurrentDecoderLayer's)
        self.post_attention_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp
        self.residual_scale = arch.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` is the previous block's output, not yet added to `residual`."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self._scaled(self.mix(h, cos, sin, kv_cache, slot_mapping, plan, q_scale))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self._scaled(self.mlp(h)), residual

    def mix(self, h: torch.Tensor, *step) -> torch.Tensor:
        """The block's token mixer on its normed input: attention (a recurrent layer's mixer
        takes the same step arguments: model/recurrent.py)."""
        return self.self_attn(h, *step)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_scale == 1.0 else h * self.residual_scale


class SandwichDecoderLayer(nn.Module):
    """Gemma 2/3's block: each sublayer's output normed again before it joins the residual,
    x + post_attention_norm(attn(input_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(.))).
    `norm` builds its norms (the family's RMSNorm). Without `pre_norms` (OLMo 2's block) the
    sublayers take the residual stream itself: x + post_attention_norm(attn(x)), then
    + post_ffw_norm(mlp(.)); input_layernorm and pre_feedforward_layernorm are then None. Like
    DecoderLayer, it returns its output not yet added to the residual stream (the next layer,
    or the final norm, adds it)."""

    def __init__(
        self,
        arch: ModelArch,
        self_attn: Attention | None,
        mlp: GatedMLP,
        norm: type[RMSNorm] = RMSNorm,
        pre_norms: bool = True,
    ) -> None:
        super().__init__()
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = norm(size, eps) if pre_norms else None
        self.self_attn = self_attn  # None: another mixer (RecurrentSandwichDecoderLayer's)
        self.post_attention_layernorm = norm(size, eps)
        self.pre_feedforward_layernorm = norm(size, eps) if pre_norms else None
        self.mlp = mlp
        self.post_feedforward_layernorm = norm(size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = _add_and_norm(self.input_layernorm, x, residual)
        h = self.mix(h, cos, sin, kv_cache, slot_mapping, plan, q_scale)
        h = self.post_attention_layernorm(h)
        h, residual = _add_and_norm(self.pre_feedforward_layernorm, h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def mix(self, h: torch.Tensor, *step) -> torch.Tensor:
        """The block's token mixer, as DecoderLayer.mix."""
        return self.self_attn(h, *step)


def _add_and_norm(
    norm: RMSNorm | None, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x); no norm: the sum twice (decode_layer.c adds in the
    same order: x + residual)."""
    if norm is not None:
        return norm.add_and_norm(x, residual)
    residual = x if residual is None else x + residual
    return residual, residual
