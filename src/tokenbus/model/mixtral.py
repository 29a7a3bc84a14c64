"""Mixtral: the Llama/Mistral attention and a sparse MoE block (model/moe.py) in every layer,
named `block_sparse_moe` with experts' w1 (gate), w3 (up), w2 (down). Routing: softmax of the
top-k logits, which is the renormalised top k of the full softmax (norm_topk_prob on)."""

from __future__ import annotations

from tokenbus.model.moe_causal_lm import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    family = "mixtral"
    moe_scope = "block_sparse_moe."
