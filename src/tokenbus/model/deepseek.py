"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM: DeepSeek-V2(-Lite),
DeepSeek-V3/R1, Kimi K2, Moonlight; Glm4MoeLiteForCausalLM: GLM-4.7-Flash): multi-head latent
attention (model/mla.py) in every layer, a dense MLP in the first `first_k_dense_replace`, then
sparse MoE blocks (model/moe.py) with an ungated shared MLP.

- DeepSeek-V2's router: a softmax over the experts, the top k, their weights renormalised where
  `norm_topk_prob` says, then scaled by `routed_scaling_factor`.
- DeepSeek-V3's (and GLM-4.7-Flash's): GLM-4.5's, each expert's sigmoid, the top k by score +
  e_score_correction_bias within the best `topk_group` of `n_group` groups
  (loader/deepseek_config.py).
"""

from __future__ import annotations

from tokenbus.model.mla import LatentAttention, latent_attention_loaders
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.weights import WeightLoader
from tokenbus.model_arch import ModelArch


class DeepseekForCausalLM(MoECausalLM):
    family = "deepseek"
    moe_scope = "mlp."

    def make_attention(self, arch: ModelArch, tp: TensorParallel) -> LatentAttention:
        return LatentAttention(arch, tp)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        return {**super()._weight_loaders(), **latent_attention_loaders(self.layers)}
