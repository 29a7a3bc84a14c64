"""ERNIE 4.5 (Baidu): Llama's layers, dense (Ernie4_5ForCausalLM, served by LlamaForCausalLM)
or with a sparse MoE MLP (Ernie4_5_MoeForCausalLM) in the layers its config names. Its rotary
turns adjacent pairs; the loader reorders its q/k rows so ours turns them
(loader/ernie_config.py). The MoE block (model/moe.py) chooses each token's experts by their
probabilities plus a per-expert bias and adds an ungated shared MLP."""

from __future__ import annotations

from tokenbus.model.moe_causal_lm import MoECausalLM


class Ernie45MoeForCausalLM(MoECausalLM):
    family = "ernie4_5_moe"
    moe_scope = "mlp."
