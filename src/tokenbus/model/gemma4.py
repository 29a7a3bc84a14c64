"""Gemma 4 (text: E2B, E4B, 26B-A4B, 31B): Gemma 3n's attention, per-layer inputs and K/V
sharing without its AltUp streams, LAuReL or sparse gates, each part from HF's Gemma4TextModel
op for op.

- Two kinds of layer: local ones (a sliding window, heads of head_dim, the default RoPE of
  their own base) and global ones with wider heads (global_head_dim, 512 by default) and, where
  attention_k_eq_v, fewer KV heads whose values are their keys' projection (no v_proj; the
  value takes v's norm, not k's, and no rotary). Each layer is built from its own shape
  (ModelArch.layer_kv_shapes) and the paged cache holds each layer's K/V in it
  (worker/kv_cache.py). The global layers' RoPE is "proportional": only the first quarter of
  the angles turn, as rotate-half pairs over the whole head (model/layers/rotary.py).
- q and k RMSNormed per head, v without a weight; attention scale 1.
- Gemma 3's sandwich norms around attention and the GeGLU MLP; the layers reading another's
  K/V may have an MLP twice as wide (use_double_wide_mlp: ModelArch.layer_intermediate_sizes).
- Per-layer inputs (E2B, E4B): Gemma 3n's, joined after the MLP (model/gemma3n.py).
- Each layer's output is scaled by its own trained scalar (`layer_scalar`).
- Norms are plain RMSNorms in fp32 (w, not Gemma's 1 + w); the embedding is scaled by
  sqrt(hidden); the final logits are soft-capped.
- The 26B-A4B (enable_moe_block): tanh-GELU experts beside every layer's MLP, each with norms
  of its own, the two outputs summed before the post-MLP norm; the router reads the residual
  stream (Gemma4Experts), the experts its own pre-norm.

A decode step on GGUF tiles runs the layers in one C call (model/c_layers.py), experts too;
otherwise they run op by op, with GGUF blocks in the linears and experts.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch import nn

from tokenbus.model.attention import Plan
from tokenbus.model.causal_lm import GLOBAL_ROPE, LOCAL_ROPE
from tokenbus.model.decoder import GeGLUMLP
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.gemma import GemmaForCausalLM
from tokenbus.model.gemma3n import Gemma3nAttention, Gemma3nForCausalLM, PerLayerInputLayer
from tokenbus.model.layers import Fp32RMSNorm, Linear
from tokenbus.model.moe import SparseMoeBlock, skip_weight, stacked_experts_split
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader, copy_param, layer_loaders, load_strictly
from tokenbus.model_arch import ModelArch

# the norms around a layer's experts (beside its MLP's): of the MLP's output, of the experts'
# input, of their output
EXPERT_NORMS = (
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
)


def layer_arch(arch: ModelArch, layer: int) -> ModelArch:
    """The shape decoder layer `layer` is built from: its KV heads, head size and MLP width."""
    heads, head_dim = arch.kv_shape(layer)
    widths = arch.layer_intermediate_sizes
    return dataclasses.replace(
        arch,
        num_key_value_heads=heads,
        head_dim=head_dim,
        intermediate_size=widths[layer] if widths else arch.intermediate_size,
        layer_kv_shapes=(),
        layer_intermediate_sizes=(),
    )


class Gemma4Attention(Gemma3nAttention):
    """Gemma 3n's attention; with `k_eq_v` the values are the keys' projection (qkv_proj
    projects q and k only)."""

    def __init__(
        self,
        arch: ModelArch,
        tp: TensorParallel,
        owner: Gemma4Attention | None = None,
        k_eq_v: bool = False,
    ) -> None:
        super().__init__(arch, tp, owner)
        self.k_eq_v = k_eq_v and owner is None
        if self.k_eq_v:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.qkv_proj = Linear(arch.hidden_size, (q_size, kv_size))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        qkv = super().project(x)
        if not self.k_eq_v:
            return qkv
        # v: the keys as projected, before k's norm and rotary change them in place
        return torch.cat((qkv, qkv[:, self.num_heads :]), dim=1)


class Gemma4Experts(SparseMoeBlock):
    """The 26B-A4B's experts beside each layer's MLP (tanh-GELU experts): its router reads the
    residual stream RMSNormed without a weight, scaled per channel (`router_scale`) and by
    1 / sqrt(hidden); softmax, the top k renormalised, each weight then scaled by its expert's
    `per_expert_scale` (HF's Gemma4TextRouter)."""

    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__(arch, tp)
        self.eps = arch.rms_norm_eps
        self.router_scale = nn.Parameter(torch.ones(arch.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(arch.num_experts), requires_grad=False)
        self.root_size = arch.hidden_size**-0.5

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.float()  # HF's weightless norm, in fp32: times (mean square + eps) ** -0.5
        h = (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        probs = torch.softmax(self.gate(h * self.router_scale * self.root_size).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[expert_ids]).to(x.dtype), expert_ids

    def gemma4_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """HF's names under the layer (`prefix`: "model.layers.N."): router.*, and each expert's
        gate, up and down under mlp.experts.E (load_weights splits HF's stacked experts so, as
        the GGUF loader splits llama.cpp's); other ranks' experts are read and dropped."""
        loaders = self.weight_loaders(f"{prefix}mlp.", "gemma4")
        loaders.update(self.skipped_names(f"{prefix}mlp.", "gemma4"))
        del loaders[f"{prefix}mlp.gate.weight"]  # the router is router.proj
        loaders[f"{prefix}router.proj.weight"] = self.gate.load_shard
        loaders[f"{prefix}router.scale"] = partial(copy_param, self.router_scale)
        loaders[f"{prefix}router.per_expert_scale"] = partial(copy_param, self.per_expert_scale)
        return loaders


class Gemma4DecoderLayer(PerLayerInputLayer):
    """Gemma 3's sandwich block, then the per-layer input joined (where the model has them),
    the output scaled by `layer_scalar`. It takes and gives back (x [T, H], per-layer inputs
    [T, L, P] or an empty tensor): the second tensor KernelPlan.run_layers carries."""

    def __init__(
        self,
        arch: ModelArch,
        index: int,
        self_attn: Gemma4Attention,
        mlp: GeGLUMLP,
        experts: Gemma4Experts | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.index = index
        self.input_layernorm = Fp32RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = Fp32RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Fp32RMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Fp32RMSNorm(hidden, eps)
        self.experts = experts  # beside the MLP, each with norms of its own
        if experts is not None:
            self.post_feedforward_layernorm_1 = Fp32RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Fp32RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Fp32RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.joins_per_layer_input = bool(arch.per_layer_input_size)
        if self.joins_per_layer_input:
            self.add_per_layer_input(arch)

    def forward(
        self,
        x: torch.Tensor,
        per_layer_inputs: torch.Tensor,
        cos: tuple[torch.Tensor, torch.Tensor],
        sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn(
            self.input_layernorm(x), cos, sin, kv_cache, slot_mapping, plan, q_scale
        )
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            routed = self.experts(self.pre_feedforward_layernorm_2(x), routed_by=x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.joins_per_layer_input:
            x = x + self.per_layer_input(x, per_layer_inputs)
        return x * self.layer_scalar, per_layer_inputs


class Gemma4ForCausalLM(Gemma3nForCausalLM):
    """Gemma 3n's model (embedding, per-layer inputs, K/V sharing) with one stream: no AltUp
    projections (altup_inputs is 0), and without per-layer inputs where the model has none
    (31B). Its global and local layers read RoPE tables of their own head sizes (CausalLM's
    rotary over arch.global_head_dim, its local_rotary over head_dim)."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        for layer in self.layers:  # CausalLM gave the local layers LOCAL_ROPE
            if layer.self_attn.sliding_window is None:
                layer.self_attn.rope_table = GLOBAL_ROPE
        if not arch.per_layer_input_size:
            self.embed_tokens_per_layer = self.per_layer_model_projection = None
            self.per_layer_projection_norm = None

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> Gemma4DecoderLayer:
        index = self.making_layer
        own, owner = layer_arch(arch, index), arch.kv_owner(index)
        local = bool(arch.sliding_windows) and arch.sliding_windows[index] is not None
        attn = Gemma4Attention(
            own,
            tp,
            None if owner == index else self.layers[owner].self_attn,
            k_eq_v=arch.attn_k_eq_v and not local,
        )
        experts = Gemma4Experts(arch, tp) if arch.num_experts else None
        return Gemma4DecoderLayer(arch, index, attn, GeGLUMLP(own, tp), experts)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None
    ) -> torch.Tensor:
        num_layers = self.start_step(ctx, num_layers)
        x = self._embed(input_ids)  # [T, hidden], scaled by sqrt(hidden)
        if self.arch.per_layer_input_size:
            per_layer_inputs = self._per_layer_inputs(input_ids, x)
        else:
            per_layer_inputs = x.new_empty(0)
        cos, sin = self.rotary_lookup(ctx.positions, x.dtype)
        x, _ = self.kernels.run_layers(
            self.layers, num_layers, x, cos, sin, ctx, carry=per_layer_inputs
        )
        return self.norm(x)

    def rotary_lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """(global, local) cos and sin, each [T, 1, D/2] of its own head size: a layer reads
        its row (GLOBAL_ROPE, LOCAL_ROPE) of the pair."""
        global_cos, global_sin = self.rotary.lookup(positions, dtype)
        local_cos, local_sin = self.local_rotary.lookup(positions, dtype)
        cos, sin = [None, None], [None, None]
        cos[GLOBAL_ROPE], sin[GLOBAL_ROPE] = global_cos, global_sin
        cos[LOCAL_ROPE], sin[LOCAL_ROPE] = local_cos, local_sin
        return tuple(cos), tuple(sin)

    def input_scale(self, value: float, dtype: torch.dtype) -> float:
        """HF's Gemma 4 multiplies by Python floats: computed in fp32, rounded once."""
        return value

    # ------------------------------------------------------------------ weights
    def _loaders(self) -> tuple[dict[str, WeightLoader], set[str]]:
        """HF names -> loaders, and the names a checkpoint may leave out (a layer reading
        another's K/V has no k_proj, v_proj, k_norm of its own; released checkpoints may carry
        them: read and dropped)."""
        # CausalLM's (its norms are w, not Gemma's 1 + w), each layer's then from its own shape
        loaders = super(GemmaForCausalLM, self)._weight_loaders()
        ignored: set[str] = set()
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            attn = layer.self_attn
            loaders.update(layer_loaders(prefix, layer, self.tp, layer_arch(self.arch, index)))
            if attn.k_eq_v:
                del loaders[f"{prefix}self_attn.v_proj.weight"]
            if attn.owner is not None:
                for leaf in ("k_proj", "v_proj", "k_norm"):
                    name = f"{prefix}self_attn.{leaf}.weight"
                    loaders[name] = skip_weight
                    ignored.add(name)
            loaders[f"{prefix}layer_scalar"] = partial(copy_param, layer.layer_scalar)
            if layer.experts is not None:
                loaders.update(layer.experts.gemma4_loaders(prefix))
                for name in EXPERT_NORMS:
                    norm = getattr(layer, name)
                    loaders[f"{prefix}{name}.weight"] = partial(copy_param, norm.weight)
            if layer.joins_per_layer_input:
                loaders.update(layer.per_layer_input_loaders(prefix))
        if self.arch.per_layer_input_size:
            loaders["model.per_layer_model_projection.weight"] = partial(
                self.per_layer_model_projection.load_shard, shard=0
            )
            loaders["model.per_layer_projection_norm.weight"] = partial(
                copy_param, self.per_layer_projection_norm.weight
            )
            loaders["model.embed_tokens_per_layer.weight"] = self._load_per_layer_table
        return loaders, ignored

    def load_weights(self, weights) -> None:
        loaders, ignored = self._loaders()
        weights = stacked_experts_split(_experts_under_mlp(weights))
        load_strictly(loaders, weights, self.arch, optional=ignored)


def _experts_under_mlp(weights):
    """HF's stacked experts (model.layers.N.experts.*) under the MLP's scope, where
    stacked_experts_split takes them apart."""
    for name, tensor in weights:
        scope, _, leaf = name.rpartition(".experts.")
        if leaf in ("gate_up_proj", "down_proj") and not scope.endswith(".mlp"):
            name = f"{scope}.mlp.experts.{leaf}"
        yield name, tensor
