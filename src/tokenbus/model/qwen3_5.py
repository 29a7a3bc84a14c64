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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked experts (mlp.experts.gate_up_proj [E, 2I, hidden]: each expert's gate rows, then
    its up rows; mlp.experts.down_proj [E, hidden, I]) as per-expert views; others as they are."""
    for name, tensor in weights:
        scope, _, leaf = name.rpartition(".mlp.experts.")
        if leaf == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                yield f"{scope}.mlp.experts.{e}.gate_proj.weight", gate
                yield f"{scope}.mlp.experts.{e}.up_proj.weight", up
        elif leaf == "down_proj":
            for e in range(tensor.shape[0]):
                yield f"{scope}.mlp.experts.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
