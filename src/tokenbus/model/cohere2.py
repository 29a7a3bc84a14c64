"""Cohere2 (Cohere2ForCausalLM: Command R7B) and Cohere (CohereForCausalLM: Command R, Aya 23,
Aya Expanse): a parallel block, x + attn(norm(x)) + mlp(norm(x)) with one LayerNorm (no bias,
layers.LayerNorm) before both, and that norm last too.

- Cohere2: every fourth layer (`layer_types`' full_attention) attends to all keys without a
  rotary; the others slide over `sliding_window` keys with one (ModelArch.sliding_windows,
  nope_layers). Cohere's layers are all global, each with its rotary; Command R+'s
  (`use_qk_norm`) LayerNorm each query and key head before it, with a weight per head.
- Its rotary turns adjacent pairs; the loader reorders its q/k rows, pairs to halves
  (loader/model_loader.py), as for ERNIE 4.5 and GLM-4, and Command R+'s per-head norm
  weights with them.
- The logits are multiplied by `logit_scale` (ModelArch.logits_scaling holds its inverse, as
  Granite's divisor).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenbus.model.attention import Plan
from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, GatedMLP, QKNorm
from tokenbus.model.layers import LayerNorm
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader, copy_param
from tokenbus.model_arch import ModelArch


class CohereAttention(Attention):
    """Command R+'s attention (`use_qk_norm`): each query and key head LayerNormed with a
    weight of its own, [heads, D], before the rotary; otherwise the shared attention."""

    def __init__(self, arch: ModelArch, tp: TensorParallel, bias: bool) -> None:
        super().__init__(arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=QKNorm.HEADS)
        eps, d = arch.rms_norm_eps, self.head_dim
        self.q_norm = LayerNorm((self.num_heads, d), eps)
        self.k_norm = LayerNorm((self.num_kv_heads, d), eps)
        # this rank's first query and KV head: where its rows start in HF's [all heads, D]
        self.first_heads = (tp.rank * self.num_heads, tp.kv_head_start(arch.num_key_value_heads))

    def _head_norms_(self, q: torch.Tensor, k: torch.Tensor) -> None:
        for view, norm in ((q, self.q_norm), (k, self.k_norm)):
            heads = view[:, : norm.weight.shape[0]]  # q's heads, or k's (v's follow in qkv)
            heads.copy_(norm(heads))

    def norm_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """q_norm's and k_norm's HF names under `prefix` ("model.layers.N."): this rank's rows."""

        def rows(norm: LayerNorm, first: int) -> WeightLoader:
            def load(name: str, tensor: torch.Tensor) -> None:
                copy_param(norm.weight, name, tensor[first : first + norm.weight.shape[0]])

            return load

        norms = (("q_norm", self.q_norm), ("k_norm", self.k_norm))
        return {
            f"{prefix}self_attn.{name}.weight": rows(norm, first)
            for (name, norm), first in zip(norms, self.first_heads, strict=True)
        }


class ParallelDecoderLayer(nn.Module):
    """attn and mlp of the same normed input, both joining the residual stream. Like
    DecoderLayer it returns its output not yet added: the MLP's, with the attention's already in
    the stream, so the next add gives (residual + attn) + mlp, HF's order."""

    def __init__(
        self, arch: ModelArch, self_attn: Attention, mlp: GatedMLP, norm: type[nn.Module]
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn
        self.mlp = mlp

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
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, cos, sin, kv_cache, slot_mapping, plan, q_scale)
        return self.mlp(h), residual + attn


class Cohere2ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        self.norm = LayerNorm(arch.hidden_size, arch.rms_norm_eps)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> ParallelDecoderLayer:
        bias = arch.attention_bias
        if arch.attn_qk_norm:
            attention = CohereAttention(arch, tp, bias)
        else:
            attention = Attention(arch, tp, qkv_bias=bias, o_bias=bias)
        return ParallelDecoderLayer(arch, attention, GatedMLP(arch, tp), LayerNorm)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        for idx, layer in enumerate(self.layers):
            if isinstance(layer.self_attn, CohereAttention):
                loaders.update(layer.self_attn.norm_loaders(f"model.layers.{idx}."))
        return loaders

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.arch.logits_scaling
