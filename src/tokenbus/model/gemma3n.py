"""Gemma 3n (text: E2B, E4B): Gemma 3's attention and sandwich norms around four ideas of its
own, each from HF's Gemma3nTextModel op for op.

- Per-layer inputs: every layer also takes a small vector per token (per_layer_input_size, 256):
  its slice of a second embedding table of all layers' vectors (the first per_layer_vocab_size
  ids; others read row 0), scaled by sqrt(256), plus a projection of the token's embedding,
  normed, the sum scaled by 1/sqrt(2). A layer gates its output into it (GELU) and projects
  back.
- AltUp: the hidden state is altup_inputs streams (4) [n, T, H]; the embedding is stream 0 and
  its projections, rescaled to its magnitude, the others. Each layer predicts every stream from
  all of them (coefficients routed by stream 0), runs attention and MLP on stream 0's
  prediction only, and corrects every stream by the innovation; at the end the streams are
  projected back, rescaled and averaged.
- LAuReL: a low-rank (laurel_rank) residual beside attention, joined with it / sqrt(2).
- Activation sparsity: the first layers' MLP gate keeps only values above mean + 1.645 std
  (the 95th percentile of a normal), per token.
- KV sharing: the last num_kv_shared_layers layers compute queries only and attend the K/V of
  the last earlier layer of their kind (ModelArch.kv_shared_layers): they hold no pool of their
  own (worker/kv_cache.py gives them their owner's) and pass their owner's K/V of this step to
  the attention, whose write puts the same values in the same slots again.

Norms are plain RMSNorms computed in fp32 (w, not Gemma's 1 + w); v is RMSNormed without a
weight; the attention scale is 1 (q and k are normed); the final logits are soft-capped.
Sliding layers take their own RoPE base as Gemma 3's do (model/gemma.py's stacked tables).
Decoder layers run op by op (no C decoder layer takes AltUp), with GGUF blocks in the linears.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tokenbus.model.attention import Plan, paged_attention
from tokenbus.model.decoder import Attention, GeGLUMLP, QKNorm
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.gemma import GemmaForCausalLM
from tokenbus.model.layers import Fp32RMSNorm, Linear, OpsModule
from tokenbus.model.layers.quantized import (
    KernelWeight,
    QuantizedWeight,
    dense,
    is_quantized,
    kernel_weight,
    quantized_embedding,
)
from tokenbus.model.moe import skip_weight
from tokenbus.model.native import QuantKernels
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader, copy_param, layer_loaders, load_strictly
from tokenbus.model_arch import ModelArch

_SQRT_HALF = float(torch.rsqrt(torch.tensor(2.0)))  # HF's per_layer_input_scale (fp32)
_MIN_MAGNITUDE_SQUARED = 1e-5  # AltUp's clamp of a projected stream's mean square


class Gemma3nAttention(Attention):
    """q/k RMSNormed per head and v without a weight, scale 1. A layer reading another's K/V
    (`owner`: that layer's attention) projects queries only and attends its owner's K/V of
    this step (`step_kv`, which an owner with readers keeps)."""

    def __init__(
        self, arch: ModelArch, tp: TensorParallel, owner: Gemma3nAttention | None = None
    ) -> None:
        super().__init__(arch, tp, qk_norm=QKNorm.HEADS, norm=Fp32RMSNorm)
        self.scale = 1.0
        self.register_buffer("v_norm_weight", torch.ones(arch.head_dim), persistent=False)
        self._owner = (owner,)  # a tuple: the owner is another layer's module, not this one's
        self.keeps_kv = False  # set on an owner when a reader is made
        self.step_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        if owner is not None:
            owner.keeps_kv = True
            self.qkv_proj = Linear(arch.hidden_size, (self.num_heads * self.head_dim,))
            self.k_norm = None

    @property
    def owner(self) -> Gemma3nAttention | None:
        return self._owner[0]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The step's heads [T, Hq (+ 2 Hkv), D], a fresh tensor the norms and rotary change."""
        return self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)

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
        num_tokens, heads, eps = x.shape[0], self.num_heads, self.q_norm.eps
        if self.rope_table is not None:
            cos, sin = cos[self.rope_table], sin[self.rope_table]
        qkv = self.project(x)
        self.ops.head_rms_norm_(qkv, 0, heads, self.q_norm.weight, eps)
        if self.owner is None:
            kv_heads = self.num_kv_heads
            self.ops.head_rms_norm_(qkv, heads, kv_heads, self.k_norm.weight, eps)
            self.ops.head_rms_norm_(qkv, heads + kv_heads, kv_heads, self.v_norm_weight, eps)
            q, k, v = self.ops.rope(qkv, cos, sin, heads, kv_heads)
            if self.keeps_kv:
                self.step_kv = (k, v)
        else:
            q, _, _ = self.ops.rope(qkv, cos, sin, heads, 0)
            k, v = self.owner.step_kv
        out = paged_attention(
            q, k, v, kv_cache, slot_mapping, plan, self.scale, self.sliding_window
        )  # [T, Hq, D]
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, heads * self.head_dim)))


class SparseGeGLUMLP(GeGLUMLP):
    """GeGLU whose gate keeps only its values above mean + std * `sparsity_std` over each
    token's row (HF's _gaussian_topk: relu(gate - cutoff)); None: the plain GeGLU. Under tensor
    parallelism the mean and the (biased) variance are summed over the ranks' columns."""

    def __init__(self, arch: ModelArch, tp: TensorParallel, sparsity_std: float | None) -> None:
        super().__init__(arch, tp)
        self.sparsity_std = sparsity_std

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.sparsity_std is None:
            return super().act_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        multiplier = torch.tensor(self.sparsity_std, dtype=torch.float32).to(gate.dtype)
        if self.tp.enabled:
            width = gate.shape[-1] * self.tp.size
            mean = self.tp.all_reduce(gate.sum(-1, keepdim=True)) / width
            variance = self.tp.all_reduce((gate - mean).square().sum(-1, keepdim=True)) / width
            std = variance.sqrt()
        else:
            mean = torch.mean(gate, dim=-1, keepdim=True)
            std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
        gate = torch.relu(gate - (mean + std * multiplier))
        return F.gelu(gate, approximate="tanh") * up


class AltUp(nn.Module):
    """The per-layer predict and correct steps over n streams [n, T, H]: coefficients from
    tanh(router(norm(stream) / H)), predicted stream j = stream j + sum_i C[j, i] * stream i,
    corrected stream j = prediction j + (1 + c_j) * (layer output - prediction 0)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        n, hidden = arch.altup_inputs, arch.hidden_size
        self.correct_output_scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.correction_coefs = nn.Parameter(torch.empty(n, n), requires_grad=False)
        self.prediction_coefs = nn.Parameter(torch.empty(n * n, n), requires_grad=False)
        self.modality_router = nn.Parameter(torch.empty(n, hidden), requires_grad=False)
        self.router_norm = Fp32RMSNorm(hidden, arch.rms_norm_eps)
        self.router_scale = hidden**-1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = F.linear(self.router_norm(x) * self.router_scale, self.modality_router)
        return torch.tanh(routed.float()).to(x.dtype)  # [T, n]

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        n = streams.shape[0]
        coefs = F.linear(self.modalities(streams[0]), self.prediction_coefs)  # [T, n * n]
        coefs = coefs.view(-1, n, n)  # [T, j, i]
        return torch.einsum("tji,ith->jth", coefs, streams) + streams

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        coefs = F.linear(self.modalities(activated), self.correction_coefs) + 1.0  # [T, n]
        innovation = activated - predictions[0]  # [T, H]
        return innovation.unsqueeze(0) * coefs.T.unsqueeze(-1) + predictions


class Laurel(nn.Module):
    """x + norm(right(left(x))): a residual through a rank-laurel_rank bottleneck."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.linear_left = Linear(arch.hidden_size, (arch.laurel_rank,))
        self.linear_right = Linear(arch.laurel_rank, (arch.hidden_size,))
        self.post_laurel_norm = Fp32RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class PerLayerInputLayer(OpsModule):
    """A decoder layer that joins its slice of the per-layer inputs (Gemma 3n's, Gemma 4's):
    norm(projection(gelu_tanh(gate(x)) * its inputs)), under HF's module names. The gate and
    the inputs side by side go through the ops' GeGLU (decode_layer.c calls the same)."""

    index: int  # the decoder layer's, its slice of the per-layer inputs

    def add_per_layer_input(self, arch: ModelArch) -> None:
        hidden = arch.hidden_size
        self.per_layer_input_gate = Linear(hidden, (arch.per_layer_input_size,))
        self.per_layer_projection = Linear(arch.per_layer_input_size, (hidden,))
        self.post_per_layer_input_norm = Fp32RMSNorm(hidden, arch.rms_norm_eps)

    def per_layer_input(self, x: torch.Tensor, per_layer_inputs: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((self.per_layer_input_gate(x), per_layer_inputs[:, self.index]), -1)
        joined = self.per_layer_projection(self.ops.gelu_tanh_mul(gate_up))
        return self.post_per_layer_input_norm(joined)

    def per_layer_input_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """Its three tensors' HF names under `prefix` ("model.layers.N."), whole on every rank."""
        loaders: dict[str, WeightLoader] = {
            f"{prefix}{name}.weight": partial(getattr(self, name).load_shard, shard=0)
            for name in ("per_layer_input_gate", "per_layer_projection")
        }
        norm = self.post_per_layer_input_norm
        loaders[f"{prefix}post_per_layer_input_norm.weight"] = partial(copy_param, norm.weight)
        return loaders


class Gemma3nDecoderLayer(PerLayerInputLayer):
    """One layer over the AltUp streams: predict, Gemma 3's sandwich block with LAuReL on the
    active stream's prediction, correct, then the per-layer input joined into the other
    streams. It takes and gives back (streams [n, T, H], per-layer inputs [T, L, P]): the
    second tensor KernelPlan.run_layers carries between layers."""

    def __init__(
        self, arch: ModelArch, index: int, self_attn: Gemma3nAttention, mlp: SparseGeGLUMLP
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
        self.altup = AltUp(arch)
        self.correct_scale = arch.altup_correct_scale
        self.laurel = Laurel(arch)
        self.add_per_layer_input(arch)

    def forward(
        self,
        streams: torch.Tensor,
        per_layer_inputs: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        predictions = self.altup.predict(streams)
        active = predictions[0]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn = self.self_attn(normed, cos, sin, kv_cache, slot_mapping, plan, q_scale)
        attn = active + self.post_attention_layernorm(attn)
        attn_laurel = (attn + laurel) / math.sqrt(2)
        ffw = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(attn_laurel)))
        corrected = self.altup.correct(predictions, attn_laurel + ffw)
        first = corrected[0]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        corrected[1:] += self.per_layer_input(first, per_layer_inputs)
        return corrected, per_layer_inputs


class Gemma3nForCausalLM(GemmaForCausalLM):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        hidden, width = arch.hidden_size, arch.num_hidden_layers * arch.per_layer_input_size
        self.embed_tokens_per_layer = nn.Parameter(
            torch.empty(arch.per_layer_vocab_size, width), requires_grad=False
        )
        # a GGUF table kept in blocks (then embed_tokens_per_layer is released)
        self.per_layer_quantized: QuantizedWeight | KernelWeight | None = None
        self.per_layer_model_projection = Linear(hidden, (width,))
        self.per_layer_projection_norm = Fp32RMSNorm(arch.per_layer_input_size, arch.rms_norm_eps)
        streams = range(arch.altup_inputs - 1)
        self.altup_projections = nn.ModuleList(Linear(hidden, (hidden,)) for _ in streams)
        self.altup_unembed_projections = nn.ModuleList(Linear(hidden, (hidden,)) for _ in streams)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> Gemma3nDecoderLayer:
        index = self.making_layer
        owner = arch.kv_owner(index)
        attn = Gemma3nAttention(arch, tp, None if owner == index else self.layers[owner].self_attn)
        sparsity = arch.activation_sparsity_std[index] if arch.activation_sparsity_std else None
        return Gemma3nDecoderLayer(arch, index, attn, SparseGeGLUMLP(arch, tp, sparsity))

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None
    ) -> torch.Tensor:
        num_layers = self.start_step(ctx, num_layers)
        x = self._embed(input_ids)  # [T, hidden], scaled by sqrt(hidden)
        per_layer_inputs = self._per_layer_inputs(input_ids, x)
        cos, sin = self.rotary_lookup(ctx.positions, x.dtype)
        streams, _ = self.kernels.run_layers(
            self.layers, num_layers, self._spread(x), cos, sin, ctx, carry=per_layer_inputs
        )
        return self.norm(self._merge(streams))

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: (norm(projection of x / sqrt(hidden)) + own embedding * sqrt(P)) / sqrt(2)."""
        arch, dtype = self.arch, x.dtype
        shape = (x.shape[0], arch.num_hidden_layers, arch.per_layer_input_size)
        ids = torch.where(input_ids < arch.per_layer_vocab_size, input_ids, 0)
        if self.per_layer_quantized is not None:
            own = quantized_embedding(self.kernels.quant, self.per_layer_quantized, ids, dtype)
        else:
            own = F.embedding(ids, self.embed_tokens_per_layer)
        own = own * _scale(arch.per_layer_input_size**0.5, dtype)
        projected = self.per_layer_model_projection(x) * self.input_scale(
            arch.hidden_size**-0.5, dtype
        )
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + own.view(shape)) * self.input_scale(_SQRT_HALF, dtype)

    def input_scale(self, value: float, dtype: torch.dtype) -> torch.Tensor | float:
        """The projection's and the sum's scale as HF applies them: Gemma 3n's an fp32 tensor
        cast to the activations' dtype (rounded there in bf16)."""
        return _scale(value, dtype)

    def _spread(self, x: torch.Tensor) -> torch.Tensor:
        """The AltUp streams [n, T, H]: x, then each projection of x at x's magnitude."""
        return torch.stack([x, *(_rescaled(p(x), x) for p in self.altup_projections)])

    def _merge(self, streams: torch.Tensor) -> torch.Tensor:
        """The mean of stream 0 and the others projected back at stream 0's magnitude."""
        first = streams[0]
        others = (
            _rescaled(p(s), first) for p, s in zip(self.altup_unembed_projections, streams[1:])
        )
        return torch.stack([first, *others]).mean(dim=0)

    def quantized_tables(self) -> list[QuantizedWeight | KernelWeight]:
        tables = super().quantized_tables()
        return tables if self.per_layer_quantized is None else [*tables, self.per_layer_quantized]

    def finalize_tables(self, quant: QuantKernels | None) -> None:
        super().finalize_tables(quant)
        if self.per_layer_quantized is not None:
            self.per_layer_quantized = kernel_weight(quant, self.per_layer_quantized)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights) -> None:
        loaders, ignored = self._loaders()
        load_strictly(loaders, weights, self.arch, optional=ignored)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        return self._loaders()[0]

    def _loaders(self) -> tuple[dict[str, WeightLoader], set[str]]:
        """HF names -> loaders, and the names a checkpoint may leave out: a layer reading
        another's K/V has no k_proj, v_proj or k_norm of its own (released checkpoints still
        carry them; they are read and dropped)."""
        loaders = super(GemmaForCausalLM, self)._weight_loaders()  # its norms are w, not 1 + w
        ignored: set[str] = set()
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            loaders.update(layer_loaders(prefix, layer, self.tp, self.arch))
            if layer.self_attn.owner is not None:
                for leaf in ("k_proj", "v_proj", "k_norm"):
                    name = f"{prefix}self_attn.{leaf}.weight"
                    loaders[name] = skip_weight
                    ignored.add(name)
            loaders.update(self._extra_layer_loaders(prefix, layer))
        model = {
            "per_layer_model_projection": self.per_layer_model_projection,
            **{f"altup_projections.{i}": p for i, p in enumerate(self.altup_projections)},
            **{
                f"altup_unembed_projections.{i}": p
                for i, p in enumerate(self.altup_unembed_projections)
            },
        }
        for name, linear in model.items():
            loaders[f"model.{name}.weight"] = partial(linear.load_shard, shard=0)
        loaders["model.per_layer_projection_norm.weight"] = partial(
            copy_param, self.per_layer_projection_norm.weight
        )
        loaders["model.embed_tokens_per_layer.weight"] = self._load_per_layer_table
        return loaders, ignored

    def _extra_layer_loaders(
        self, prefix: str, layer: Gemma3nDecoderLayer
    ) -> dict[str, WeightLoader]:
        """A layer's AltUp, LAuReL and per-layer-input tensors (whole on every rank)."""
        linears = {
            "laurel.linear_left": layer.laurel.linear_left,
            "laurel.linear_right": layer.laurel.linear_right,
        }
        loaders: dict[str, WeightLoader] = {
            f"{prefix}{name}.weight": partial(linear.load_shard, shard=0)
            for name, linear in linears.items()
        }
        norms = {
            "laurel.post_laurel_norm": layer.laurel.post_laurel_norm,
            "altup.router_norm": layer.altup.router_norm,
        }
        for name, norm in norms.items():
            loaders[f"{prefix}{name}.weight"] = partial(copy_param, norm.weight)
        loaders.update(layer.per_layer_input_loaders(prefix))
        altup = layer.altup
        params = {
            "altup.correct_output_scale": altup.correct_output_scale,
            "altup.correction_coefs.weight": altup.correction_coefs,
            "altup.prediction_coefs.weight": altup.prediction_coefs,
            "altup.modality_router.weight": altup.modality_router,
        }
        for name, param in params.items():  # small: dense whatever the file stores
            loaders[f"{prefix}{name}"] = _dense_loader(param)
        return loaders

    def _load_per_layer_table(self, name: str, tensor) -> None:
        if not is_quantized(tensor):
            copy_param(self.embed_tokens_per_layer, name, tensor)
            return
        expected = tuple(self.embed_tokens_per_layer.shape)
        if (tensor.rows, tensor.cols) != expected:
            raise ValueError(
                f"weight {name}: expected shape {list(expected)}, got {[tensor.rows, tensor.cols]}"
            )
        self.per_layer_quantized = tensor  # rows dequantized as tokens need them
        self.embed_tokens_per_layer = nn.Parameter(
            self.embed_tokens_per_layer.new_empty(0, expected[1]), requires_grad=False
        )


def _dense_loader(param: torch.Tensor) -> WeightLoader:
    def load(name: str, tensor) -> None:
        copy_param(
            param, name, dense(tensor).reshape(param.shape) if is_quantized(tensor) else tensor
        )

    return load


def _scale(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A scale as HF holds it: an fp32 tensor cast to the activations' dtype."""
    return torch.tensor(value, dtype=torch.float32).to(dtype)


def _rescaled(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """y at the root-mean-square magnitude of `like` (per token), as HF's AltUp rescales."""
    target = torch.mean(like**2, dim=-1, keepdim=True) ** 0.5
    magnitude = torch.sqrt(torch.mean(y**2, dim=-1, keepdim=True).clamp(min=_MIN_MAGNITUDE_SQUARED))
    return y * target / magnitude
