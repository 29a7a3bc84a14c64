"""GLM-4.5 (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7): Llama's pre-norm layers
with DeepSeek-V3's sparse MoE MLP (model/moe.py) after the first `first_k_dense_replace`
layers.

- Attention: q/k/v with biases, o_proj without; per-head q/k RMSNorms where the config says
  `use_qk_norm` (arch.attn_qk_norm); half of each head turning, in NeoX's layout.
- MoE: each expert scored by its sigmoid, the top k chosen by score + e_score_correction_bias
  (within the best groups where `n_group` > 1), weighed by the scores renormalised and scaled
  by `routed_scaling_factor`; an ungated shared MLP (`shared_experts`) added to every token.
- The multi-token-prediction layers after the model's are not read (loader/glm4_moe_config.py).

Solar Open (SolarOpenForCausalLM) is served here too: every layer GLM-4.5's MoE, its attention
without biases or q/k norms, the whole head turning (its config says so; the class is the same);
and dots.llm1 (Dots1ForCausalLM): GLM-4.5's MoE under Qwen3's attention (q/k norms, the whole
head turning; an attention bias, where its config asks, on o_proj too).
"""

from __future__ import annotations

from tokenbus.model.decoder import Attention, QKNorm
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch


class Glm4MoeForCausalLM(MoECausalLM):
    family = "glm4_moe"
    moe_scope = "mlp."

    def make_attention(self, arch: ModelArch, tp: TensorParallel) -> Attention:
        qk_norm = QKNorm.HEADS if arch.attn_qk_norm else QKNorm.NONE
        o_bias = arch.attention_bias and arch.architecture == "dots1"  # Qwen3's
        return Attention(arch, tp, qkv_bias=arch.attention_bias, o_bias=o_bias, qk_norm=qk_norm)
