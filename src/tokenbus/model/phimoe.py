"""PhiMoE (PhimoeForCausalLM: Phi-3.5-MoE, Phi-mini-MoE, Phi-tiny-MoE): Mixtral's layers
(`block_sparse_moe`, experts' w1, w3, w2) with three changes:

- every norm is a LayerNorm with a bias (nn.LayerNorm's, in the activations' dtype), the
  final one too, so the C decode layers leave its steps to torch;
- the router picks two experts one after the other by PhiMoE's sparsemixer (model/moe.py):
  each weighed by a softmax over the logits near the best one left, not renormalised;
- the LM head may carry a bias (lm_head_bias), and q/k/v and o_proj do with attention_bias.

Its LongRoPE (Phi-3.5-MoE's) scales cos and sin by short_mscale or long_mscale, by the factor
set the engine's context chooses (model/layers/rotary.py).
"""

from __future__ import annotations

from functools import partial

from tokenbus.model.decoder import DecoderLayer
from tokenbus.model.layers import LayerNorm
from tokenbus.model.mixtral import MixtralForCausalLM
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model_arch import ModelArch

_BIASED_LAYER_NORM = partial(LayerNorm, bias=True)


class PhimoeForCausalLM(MixtralForCausalLM):
    family = "phimoe"

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        self.norm = _BIASED_LAYER_NORM(arch.hidden_size, arch.rms_norm_eps)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        attention, mlp = self.make_attention(arch, tp), self.make_mlp(arch, tp)
        return DecoderLayer(arch, attention, mlp, _BIASED_LAYER_NORM)
