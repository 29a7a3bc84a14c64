"""OLMo 2 and OLMo 3 (AllenAI): Llama's attention and MLP in a post-norm block, with q/k norms
over the whole projection.

- No norm before a sublayer: each one takes the residual stream itself, and its output is
  normed before it joins the stream, x + post_attention_norm(attn(x)), then
  + post_ffw_norm(mlp(.)) (decoder.SandwichDecoderLayer without its pre-norms).
- q_norm and k_norm are RMSNorms over all of a token's query (key) heads at once, weights
  [Hq * D] and [Hkv * D], applied before the rotary (decoder.QKNorm.WHOLE).
- Every norm computes in fp32 and multiplies by the weight before casting back (HF's
  Olmo2RMSNorm: layers.Fp32RMSNorm).
- OLMo 3's local layers slide (ModelArch.sliding_windows) and, where its global layers take
  YaRN, turn by an unscaled table of their own (CausalLM's local RoPE).

decode_layer.c runs these layers too: a sandwich layer with no norm before its sublayers, and
q/k norms whose rows are the whole projection.
"""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, GatedMLP, QKNorm, SandwichDecoderLayer
from tokenbus.model.layers import Fp32RMSNorm
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model_arch import ModelArch


class Olmo2ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        self.norm = Fp32RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> SandwichDecoderLayer:
        bias = arch.attention_bias
        attention = Attention(
            arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=QKNorm.WHOLE, norm=Fp32RMSNorm
        )
        return SandwichDecoderLayer(
            arch, attention, GatedMLP(arch, tp), Fp32RMSNorm, pre_norms=False
        )
