"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on q/k/v, none on
o_proj) and a sparse MoE block (model/moe.py) with a shared expert beside the routed ones, its
output scaled by sigmoid(shared_expert_gate(x)). Routing: softmax over all experts, top k,
renormalised iff `norm_topk_prob` (off in the released configs); `mlp_only_layers` and
`decoder_sparse_step` keep a dense MLP where they say (arch.dense_layers)."""

from __future__ import annotations

from tokenbus.model.decoder import Attention
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch


class Qwen2MoeForCausalLM(MoECausalLM):
    family = "qwen2_moe"
    moe_scope = "mlp."

    def make_attention(self, arch: ModelArch, tp: TensorParallel) -> Attention:
        return Attention(arch, tp, qkv_bias=arch.attention_bias, o_bias=False)
