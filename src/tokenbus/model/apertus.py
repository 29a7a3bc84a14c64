"""Apertus (ApertusForCausalLM: Apertus-8B, 70B): Llama's layers with Qwen3's per-head q/k
RMSNorms before the rotary, and an MLP without a gate whose activation is xIELU, with trained
parameters of its own in every layer (HF's XIELUActivation, op for op):

    xielu(x) = alpha_p * x^2 + beta * x                        for x > 0
               alpha_n * (expm1(min(x, eps)) - x) + beta * x   otherwise

where alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n) of the layer's stored a_p, a_n.
Its norms are named attention_layernorm / feedforward_layernorm (loaded as the pre-norm
layer's two); a GGUF stores the four parameters of every layer as `xielu.*` arrays
(loader/apertus_config.py turns them back into the layer's tensors). The MLPs run op by op.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, QKNorm, ReluSquaredMLP
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader, copy_param
from tokenbus.model_arch import ModelArch

XIELU_PARAMETERS = ("alpha_p", "alpha_n", "beta", "eps")


class XieluMLP(ReluSquaredMLP):
    """down_proj(xielu(up_proj(x))): ReluSquaredMLP's projections (and loaders), the layer's
    xIELU between them. alpha_p / alpha_n are stored [1] (HF's parameters), beta / eps [] (its
    buffers)."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        for name, shape in zip(XIELU_PARAMETERS, ((1,), (1,), (), ())):
            setattr(self, name, nn.Parameter(torch.empty(shape), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.xielu(self.up_proj(x))))

    def xielu(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            x > 0,
            alpha_p * x * x + self.beta * x,
            (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x,
        )


class ApertusForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        if arch.hidden_act != "xielu":
            raise ValueError(f"hidden_act: only 'xielu' is supported, got {arch.hidden_act!r}")
        bias = arch.attention_bias
        attention = Attention(arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=QKNorm.HEADS)
        return DecoderLayer(arch, attention, XieluMLP(arch, tp))

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        for index, layer in enumerate(self.layers):
            for name in XIELU_PARAMETERS:
                param = getattr(layer.mlp, name)
                loaders[f"model.layers.{index}.mlp.act_fn.{name}"] = partial(copy_param, param)
        return loaders
