"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b): a pre-norm MoE decoder (L2) with parts of
its own around the shared ones.

- Attention sinks: each query head has a learned logit that joins its softmax's denominator and
  carries no value, out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)); every attention path
  takes them (decoder.Attention.sinks). q/k/v and o_proj carry biases; the scale is
  head_dim ** -0.5.
- Alternating windows: HF's `layer_types` (by default the even layers slide, over 128 keys, and
  the odd ones see everything), through the hybrid KV cache.
- YaRN RoPE (factor 32 over 4096 positions) whose correction range is not rounded to whole
  dimensions (`truncate: false`, as OpenAI's reference computes it).
- Experts with biases and a clamped SwiGLU: gate clamped from above at `swiglu_limit` (7), up
  to +-7, out gate * sigmoid(1.702 gate) * (up + 1). The router has a bias, and a token's top k
  logits are softmaxed among themselves (moe.py's renormalised top k of the softmax).

HF stores each layer's experts stacked and transposed: gate_up_proj [E, hidden, 2I] with gate
and up interleaved (column 2i the gate's, 2i + 1 the up's), down_proj [E, I, hidden], their
biases [E, 2I] and [E, hidden], and the router as `router`. They are split at load into the
per-expert names the MoE block loads, as llama.cpp's converter splits them into ffn_*_exps.
OpenAI's released checkpoints hold the experts as MXFP4 blocks; loader/mxfp4.py hands those
over per expert already (kept in their blocks, or dequantized).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenbus.model.decoder import Attention
from tokenbus.model.moe import SparseMoeBlock
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader, copy_param
from tokenbus.model_arch import ModelArch


class GptOssAttention(Attention):
    """The shared attention with biases and a sink per query head (this rank's heads'), held in
    fp32 whatever the model's dtype."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        bias = arch.attention_bias
        super().__init__(arch, tp, qkv_bias=bias, o_bias=bias)
        self.sinks = nn.Parameter(
            torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False
        )

    def load_sinks(self, name: str, tensor: torch.Tensor) -> None:
        """HF's sinks [all heads]: this rank's heads' part."""
        first = self.tp.rank * self.num_heads
        copy_param(self.sinks, name, tensor[first : first + self.num_heads])


class GptOssForCausalLM(MoECausalLM):
    family = "gpt_oss"
    moe_scope = "mlp."

    def make_attention(self, arch: ModelArch, tp: TensorParallel) -> Attention:
        return GptOssAttention(arch, tp)

    def make_mlp(self, arch: ModelArch, tp: TensorParallel) -> SparseMoeBlock:
        return SparseMoeBlock(arch, tp, bias=True)  # its clamped SwiGLU: arch.swiglu_limit

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        for idx, layer in enumerate(self.layers):
            loaders[f"model.layers.{idx}.self_attn.sinks"] = layer.self_attn.load_sinks
        return loaders

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's stacked gpt-oss experts and its `router` as the per-expert names and `gate` the MoE
    block loads (views, no copy); others (a GGUF's, already per expert) as they are."""
    for name, tensor in weights:
        scope, _, leaf = name.rpartition(".mlp.")
        if not scope:
            yield name, tensor
            continue
        experts = f"{scope}.mlp.experts"
        if leaf in ("router.weight", "router.bias"):
            yield f"{scope}.mlp.gate.{leaf.split('.')[1]}", tensor
        elif leaf == "experts.gate_up_proj":  # [E, hidden, 2I]: gate, up interleaved columns
            for e in range(tensor.shape[0]):
                yield f"{experts}.{e}.gate_proj.weight", tensor[e, :, 0::2].T
                yield f"{experts}.{e}.up_proj.weight", tensor[e, :, 1::2].T
        elif leaf == "experts.gate_up_proj_bias":  # [E, 2I]
            for e in range(tensor.shape[0]):
                yield f"{experts}.{e}.gate_proj.bias", tensor[e, 0::2]
                yield f"{experts}.{e}.up_proj.bias", tensor[e, 1::2]
        elif leaf == "experts.down_proj":  # [E, I, hidden]
            for e in range(tensor.shape[0]):
                yield f"{experts}.{e}.down_proj.weight", tensor[e].T
        elif leaf == "experts.down_proj_bias":  # [E, hidden]
            for e in range(tensor.shape[0]):
                yield f"{experts}.{e}.down_proj.bias", tensor[e]
        else:
            yield name, tensor
