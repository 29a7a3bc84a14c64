"""Qwen3.5 (dense: Qwen3_5ForCausalLM, and Qwen3_5ForConditionalGeneration's text model): three
Gated DeltaNet layers (model/gated_delta_net.py, a recurrent state per request) to one gated
attention layer, each followed by a SwiGLU MLP in a pre-norm block.

- Attention: Qwen3's per-head q/k norms, a partial rotary (the first quarter of each head's
  dims), and its output scaled by sigmoid(gate) before o_proj (decoder.Attention's
  output_gate). HF's q_proj holds each head's queries, then that head's gate: split here into
  q_proj and gate_proj rows.
- Every RMSNorm but the Gated DeltaNet's output norm scales by (1 + w), computed in fp32
  (layers.Fp32RMSNorm holding 1 + w, as Gemma's).
- The LM head is tied in the small models (tie_word_embeddings).

Qwen3.5-MoE (Qwen3_5MoeForCausalLM) keeps these layers and makes every MLP a sparse MoE block
(model/moe.py): softmax routing, the top k renormalised, and a shared expert behind a sigmoid
gate, Qwen2-MoE's. Its experts come per expert or stacked (transformers 5's gate_up_proj [E, 2I,
hidden] and down_proj [E, hidden, I]), read as per-expert views.

Qwen3-Next (Qwen3NextForCausalLM, 80B-A3B) is Qwen3.5-MoE's layers (dense MLPs in the layers
arch.dense_layers names) with the Gated DeltaNet's projections fused per key head, in_proj_qkvz
and in_proj_ba: split here into Qwen3.5's in_proj_qkv / z / b / a rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP, QKNorm
from tokenbus.model.gated_delta_net import GatedDeltaNet
from tokenbus.model.layers import Fp32RMSNorm
from tokenbus.model.layers.quantized import is_quantized
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.recurrent import RecurrentDecoderLayer
from tokenbus.model.weights import WeightLoader, plus_one
from tokenbus.model_arch import ModelArch


class Qwen3_5ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        self.norm = Fp32RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        mlp = self.make_mlp(arch, tp)
        if self.making_layer in arch.recurrent_layers:
            return RecurrentDecoderLayer(arch, GatedDeltaNet(arch, tp), mlp, Fp32RMSNorm)
        attention = Attention(arch, tp, qk_norm=QKNorm.HEADS, norm=Fp32RMSNorm)
        return DecoderLayer(arch, attention, mlp, Fp32RMSNorm)

    def make_mlp(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        return GatedMLP(arch, tp)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        # (1 + w) held where HF has w; the Gated DeltaNet's output norm is a plain weight
        return {
            name: plus_one(loader)
            if name.endswith("norm.weight") and ".linear_attn." not in name
            else loader
            for name, loader in loaders.items()
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_queries_and_gates(weights, self.arch))


def _queries_and_gates(
    weights: Iterable[tuple[str, torch.Tensor]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """q_proj [H * 2D, hidden], each head's D query rows then its D gate rows, as q_proj
    [H * D, hidden] and gate_proj [H * D, hidden]; a GGUF's blocks kept quantized are split
    the same way, a row being its blocks."""
    heads, dim = arch.num_attention_heads, arch.head_dim
    for name, tensor in weights:
        if not name.endswith(".self_attn.q_proj.weight"):
            yield name, tensor
            continue
        rows = tensor.data if is_quantized(tensor) else tensor
        per_head = rows.view(heads, 2, dim, rows.shape[-1])
        for part, which in ((name, 0), (name.replace(".q_proj.", ".gate_proj."), 1)):
            half = per_head[:, which].reshape(heads * dim, -1)
            yield part, dataclasses.replace(tensor, data=half) if is_quantized(tensor) else half


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, MoECausalLM):
    """Qwen3.5's layers (make_layer, its norms and gated queries) with MoECausalLM's MLPs and
    expert loading."""

    family = "qwen3_5_moe"
    make_mlp = MoECausalLM.make_mlp


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    family = "qwen3_next"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_unfused_projections(weights, self.arch))


def _unfused_projections(
    weights: Iterable[tuple[str, torch.Tensor]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's in_proj_qkvz (per key head: its q and k rows, its value heads' v rows, then
    their z rows) and in_proj_ba (per key head: its value heads' b rows, then their a rows) as
    Qwen3.5's in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b and in_proj_a; a GGUF's
    quantized rows the same way, a row being its blocks."""
    k_heads, k_dim, v_dim = arch.delta_k_heads, arch.delta_k_dim, arch.delta_v_dim
    per_key = arch.delta_v_heads // k_heads  # value heads a key head serves
    for name, tensor in weights:
        scope, _, leaf = name.rpartition(".linear_attn.")
        if leaf not in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
            yield name, tensor
            continue
        quantized = is_quantized(tensor)
        rows = tensor.data if quantized else tensor

        def rows_of(parts: list[torch.Tensor]) -> torch.Tensor:
            joined = torch.cat([part.reshape(-1, rows.shape[-1]) for part in parts])
            return dataclasses.replace(tensor, data=joined) if quantized else joined

        if leaf == "in_proj_qkvz.weight":
            sizes = [k_dim, k_dim, per_key * v_dim, per_key * v_dim]
            q, k, v, z = rows.view(k_heads, sum(sizes), -1).split(sizes, dim=1)
            yield f"{scope}.linear_attn.in_proj_qkv.weight", rows_of([q, k, v])
            yield f"{scope}.linear_attn.in_proj_z.weight", rows_of([z])
        else:
            b, a = rows.view(k_heads, 2 * per_key, -1).split([per_key, per_key], dim=1)
            yield f"{scope}.linear_attn.in_proj_b.weight", rows_of([b])
            yield f"{scope}.linear_attn.in_proj_a.weight", rows_of([a])
