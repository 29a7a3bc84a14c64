"""Arcee (ArceeForCausalLM: AFM-4.5B): Llama's layers whose MLP has no gate,
down_proj(relu(up_proj(x)) ** 2) (decoder.ReluSquaredMLP, Nemotron's). Its `hidden_act` must say
relu2. Those MLPs run op by op (the C decoder layers take gated MLPs only)."""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, ReluSquaredMLP
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch


class ArceeForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        if arch.hidden_act != "relu2":
            raise ValueError(f"hidden_act: only 'relu2' is supported, got {arch.hidden_act!r}")
        bias = arch.attention_bias
        attention = Attention(arch, tp, qkv_bias=bias, o_bias=bias)
        return DecoderLayer(arch, attention, ReluSquaredMLP(arch, tp))
