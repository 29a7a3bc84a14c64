"""OLMoE (AllenAI): a pre-norm Llama decoder whose every MLP is a sparse MoE block
(model/moe.py; softmax over all experts, top k, renormalised iff `norm_topk_prob`, off by
default), with OLMo's q/k norms over the whole projection (decoder.QKNorm.WHOLE) and Llama's
RMSNorm. `clip_qkv` is refused at load."""

from __future__ import annotations

from tokenbus.model.decoder import QKNorm
from tokenbus.model.moe_causal_lm import MoECausalLM


class OlmoeForCausalLM(MoECausalLM):
    family = "olmoe"
    moe_scope = "mlp."
    qk_norm = QKNorm.WHOLE
