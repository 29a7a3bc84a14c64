"""The Llama family (Llama/SmolLM2, Mistral, Qwen2, dense ERNIE 4.5, Seed-OSS): model/decoder.py's
parts as they are.

Llama's and Mistral's `attention_bias` adds a bias to q/k/v and o_proj; Qwen2 has q/k/v biases
(ModelArch.attention_bias is set for it) and none on o_proj, and so has Seed-OSS (its o_proj
bias is `attention_out_bias`, off in the released model and refused at load).
"""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch


class LlamaForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        o_bias = arch.attention_bias and arch.architecture not in ("qwen2", "seed_oss")
        attention = Attention(arch, tp, qkv_bias=arch.attention_bias, o_bias=o_bias)
        return DecoderLayer(arch, attention, GatedMLP(arch, tp))
