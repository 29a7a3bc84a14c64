"""SmolLM3: Llama's layers, with no rotary on some of them (NoPE: every fourth by default).

Its NoPE layers (ModelArch.nope_layers) attend to unturned queries and keys. They read a second
RoPE table the model stacks under the real one: the identity turn, cos 1 and sin 0, which gives
every value back exactly (x * 1 - y * 0 = x), so those layers run the shared attention (and
decode_layer.c's per-layer table) unchanged, bit for bit HF's `use_rope = False`.
"""

from __future__ import annotations

import torch

from tokenbus.config import ModelArch
from tokenbus.model.llama import LlamaForCausalLM
from tokenbus.model.parallel import SINGLE, TensorParallel

ROPE, NO_ROPE = 0, 1  # rows of the stacked cos/sin tables


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        if arch.nope_layers:
            for idx, layer in enumerate(self.layers):
                layer.self_attn.rope_table = NO_ROPE if idx in arch.nope_layers else ROPE

    def rotary_lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [2, T, 1, D/2]: row ROPE, and NO_ROPE the identity turn (with no NoPE
        layer: the one table [T, 1, D/2])."""
        cos, sin = self.rotary.lookup(positions, dtype)
        if not self.arch.nope_layers:
            return cos, sin
        return torch.stack((cos, torch.ones_like(cos))), torch.stack((sin, torch.zeros_like(sin)))
