"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head, head_dim from the config) and a sparse
MoE block (model/moe.py) as the MLP of every layer except `mlp_only_layers` and those off the
`decoder_sparse_step` (those keep a dense gated MLP: arch.dense_layers). Routing: softmax over
all experts, top k, renormalised iff `norm_topk_prob`. No shared experts in this family."""

from __future__ import annotations

from tokenbus.model.decoder import QKNorm
from tokenbus.model.moe_causal_lm import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    family = "qwen3_moe"
    moe_scope = "mlp."
    qk_norm = QKNorm.HEADS
