"""Granite (IBM Granite 3.x, dense): Llama's layers with four multipliers (GraniteConfig's).

- `embedding_multiplier` scales the token embeddings;
- `residual_multiplier` scales each sublayer's output before it joins the residual
  (decoder.DecoderLayer.residual_scale, which decode_layer.c applies as well);
- `attention_multiplier` is the attention scale itself, in place of head_dim ** -0.5;
- `logits_scaling` divides the logits.

Each is the same float operation HF's forward does, at the same point, so an fp32 model gives
HF's logits bit for bit where Llama's does.
"""

from __future__ import annotations

import torch

from tokenbus.config import ModelArch
from tokenbus.model.decoder import DecoderLayer
from tokenbus.model.llama import LlamaForCausalLM
from tokenbus.model.parallel import TensorParallel


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        layer = super().make_layer(arch, tp)
        if arch.attention_multiplier is not None:
            layer.self_attn.scale = arch.attention_multiplier
        return layer

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.arch.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.arch.logits_scaling
