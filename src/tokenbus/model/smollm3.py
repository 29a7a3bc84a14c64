"""SmolLM3: Llama's layers, with no rotary on some of them (NoPE: every fourth by default).

Its NoPE layers (ModelArch.nope_layers) attend to unturned queries and keys: CausalLM gives
them the identity turn, a second RoPE table under the real one (causal_lm.NO_ROPE), as it does
for every family with NoPE layers.
"""

from __future__ import annotations

from tokenbus.model.causal_lm import GLOBAL_ROPE as ROPE
from tokenbus.model.causal_lm import NO_ROPE
from tokenbus.model.llama import LlamaForCausalLM

__all__ = ["NO_ROPE", "ROPE", "SmolLM3ForCausalLM"]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers; its NoPE layers are CausalLM's."""
