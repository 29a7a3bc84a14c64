"""EXAONE 4 (Exaone4ForCausalLM: EXAONE-4.0-1.2B, 32B): OLMo 2's post-norm block,
x + post_attention_norm(attn(x)), then + post_feedforward_norm(mlp(.)) (decoder.SandwichDecoderLayer
without its pre-norms), with Qwen3's RMSNorm of each query and key head before the rotary, and
plain (Llama's) RMSNorms. Where it has windows (the 32B: three local layers to one global), the
global layers turn no rotary (ModelArch.nope_layers).
"""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, GatedMLP, QKNorm, SandwichDecoderLayer
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch


class Exaone4ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> SandwichDecoderLayer:
        attention = Attention(arch, tp, qk_norm=QKNorm.HEADS)
        return SandwichDecoderLayer(arch, attention, GatedMLP(arch, tp), pre_norms=False)
