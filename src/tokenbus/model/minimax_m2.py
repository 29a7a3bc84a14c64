"""MiniMax-M2 (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1, M2.5): a pre-norm decoder whose attention
RMSNorms q and k over the whole projection (OLMo 2's, decoder.QKNorm.WHOLE) and turns the first
`rotary_dim` dims of each head, and whose every MLP is Mixtral's sparse MoE block
(`block_sparse_moe`) routed as DeepSeek-V3 routes without groups: each expert's sigmoid, the top
k by score + `e_score_correction_bias`, weighed by the scores renormalised (model/moe.py;
loader/minimax_m2_config.py)."""

from __future__ import annotations

from tokenbus.model.decoder import QKNorm
from tokenbus.model.moe_causal_lm import MoECausalLM


class MiniMaxM2ForCausalLM(MoECausalLM):
    family = "minimax_m2"
    moe_scope = "block_sparse_moe."
    qk_norm = QKNorm.WHOLE
