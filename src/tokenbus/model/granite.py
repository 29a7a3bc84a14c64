"""Granite (IBM Granite 3.x): Llama's layers with four multipliers (GraniteConfig's), dense or
with a sparse MoE MLP in every layer (GraniteMoE); Granite 4.0 (GraniteMoeHybrid: Granite's
layers, the MLP stored as `shared_mlp`, rotary only with position_embedding_type "rope"; the
4.0-H models' Mamba2 layers among them, and experts beside the shared MLP in 4.0-H Tiny and
Small).

- `embedding_multiplier` scales the token embeddings;
- `residual_multiplier` scales each sublayer's output before it joins the residual
  (decoder.DecoderLayer.residual_scale, which decode_layer.c applies as well);
- `attention_multiplier` is the attention scale itself, in place of head_dim ** -0.5;
- `logits_scaling` divides the logits.

Each is the same float operation HF's forward does, at the same point, so an fp32 model gives
HF's logits bit for bit where Llama's does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenbus.model.decoder import DecoderLayer, GatedMLP
from tokenbus.model.llama import LlamaForCausalLM
from tokenbus.model.mamba2 import Mamba2Mixer
from tokenbus.model.moe import SparseMoeBlock
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.recurrent import RecurrentDecoderLayer
from tokenbus.model_arch import ModelArch


class GraniteMultipliers:
    """Granite's multipliers on a CausalLM (mixed in before it): the attention scale, the
    embeddings' and the logits' factors. The residual one DecoderLayer reads from the arch."""

    arch: ModelArch

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        layer = super().make_layer(arch, tp)
        attention = getattr(layer, "self_attn", None)  # a Mamba2 layer has none
        if arch.attention_multiplier is not None and attention is not None:
            attention.scale = arch.attention_multiplier
        return layer

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.arch.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.arch.logits_scaling


class GraniteForCausalLM(GraniteMultipliers, LlamaForCausalLM):
    pass


class _GraniteHybridLayers(MoECausalLM):
    """Granite 4.0's layers: attention or a Mamba2 mixer (arch.recurrent_layers:
    model/mamba2.py), each with the dense MLP or, with experts, a sparse MoE block whose shared
    expert is the shared MLP (ungated)."""

    family = "granitemoehybrid"
    moe_scope = "mlp."  # HF's block_sparse_moe, renamed at load (_hybrid_names)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        mlp = SparseMoeBlock(arch, tp) if arch.num_experts else GatedMLP(arch, tp)
        if self.making_layer in arch.recurrent_layers:
            return RecurrentDecoderLayer(arch, Mamba2Mixer(arch, tp), mlp)
        return DecoderLayer(arch, self.make_attention(arch, tp), mlp)


class GraniteHybridForCausalLM(GraniteMultipliers, _GraniteHybridLayers):
    """Granite 4.0 (GraniteMoeHybrid): Granite's multipliers over its layers, the 4.0-H models'
    Mamba2 mixers with Granite's residual multiplier on their output too. The MLP's gate and up
    are stored as one `shared_mlp.input_linear` [2I, hidden] (gate rows, then up rows, as its
    forward chunks them) and down as `shared_mlp.output_linear`; experts (4.0-H Tiny and Small)
    as GraniteMoE stores them, under block_sparse_moe. An attention-only dense GGUF of it is a
    "granite" one (llama.cpp's converter writes it so), the others "granitehybrid"."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_hybrid_names(weights, bool(self.arch.num_experts)))


def _hybrid_names(
    weights: Iterable[tuple[str, torch.Tensor]], experts: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite 4.0's HF tensors under the names our layers load: experts split (GraniteMoE's
    _per_expert) under mlp, the shared MLP as the dense MLP or, beside experts, as their
    shared expert."""
    for name, tensor in _per_expert(_shared_mlp_as_mlp(weights, experts)):
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor


def _shared_mlp_as_mlp(
    weights: Iterable[tuple[str, torch.Tensor]], experts: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """shared_mlp.input_linear / output_linear as the dense MLP's gate, up and down (views), or
    beside experts as their shared expert's."""
    mlp = "mlp.shared_experts." if experts else "mlp."
    for name, tensor in weights:
        scope, _, leaf = name.rpartition("shared_mlp.")
        if leaf == "input_linear.weight":
            gate, up = tensor.chunk(2, dim=0)
            yield f"{scope}{mlp}gate_proj.weight", gate
            yield f"{scope}{mlp}up_proj.weight", up
        elif leaf == "output_linear.weight":
            yield f"{scope}{mlp}down_proj.weight", tensor
        else:
            yield name, tensor


class GraniteMoeForCausalLM(GraniteMultipliers, MoECausalLM):
    """GraniteMoE: every MLP a sparse MoE block, the router's top k softmaxed among themselves
    (Mixtral's rule: norm_topk_prob on). HF stores each layer's experts stacked, gate and up as
    one `input_linear` [E, 2I, hidden] and down as `output_linear` [E, hidden, I], the router as
    `router.layer`; they are split into the per-expert names the MoE block loads (a GGUF's
    stacked ffn_*_exps arrive as those already)."""

    family = "granitemoe"
    moe_scope = "block_sparse_moe."

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's stacked GraniteMoE tensors as per-expert ones (views, no copy); others as they are."""
    for name, tensor in weights:
        scope, _, leaf = name.rpartition("block_sparse_moe.")
        if not scope:
            yield name, tensor
        elif leaf == "router.layer.weight":
            yield f"{scope}block_sparse_moe.gate.weight", tensor
        elif leaf == "input_linear.weight":  # [E, 2I, hidden]: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{scope}block_sparse_moe.experts.{e}.gate_proj.weight", gate[e]
                yield f"{scope}block_sparse_moe.experts.{e}.up_proj.weight", up[e]
        elif leaf == "output_linear.weight":  # [E, hidden, I]
            for e in range(tensor.shape[0]):
                yield f"{scope}block_sparse_moe.experts.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
