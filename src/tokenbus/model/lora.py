"""LoRA adapters as a low-rank side path of the linears (L2).

A request's adapter adds `scaling · (x Aᵀ) Bᵀ` to each linear it targets. Adapters are never
merged into the base weights (which may be GGUF blocks): every linear keeps `max_loras` slots,
and a step computes the side path of all its rows at once, whatever adapters they use:

    h = x @ a          # a [in, max_loras · W]: each slot's Aᵀ, zero-padded to W columns
    h *= one-hot       # a row keeps the W columns of its own slot (none: the base model)
    y += h @ b         # b [max_loras · W, out]: each slot's scaling · Bᵀ

Two GEMMs and a multiply per linear per step, not a loop over requests or adapters. For a
fused linear (q/k/v, gate/up) a slot is W = shards · max_lora_rank wide: shard s's columns
[s · R, s · R + r) of a slot hold that shard's Aᵀ, and the same rows of b its Bᵀ under the
shard's output columns (block-diagonal), so one pair of GEMMs serves all shards.

worker/lora_slots.py decides which adapter sits in which slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus.config import LoRAConfig
from tokenbus.model.layers import Linear

LoRAPair = tuple[torch.Tensor, torch.Tensor, float]  # A [r, in], B [out_s, r], scaling

# HF target module → (our linear's name within the layer, its shard).
LORA_TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


@dataclass
class LoRABatch:
    """Which slot each row of this step uses: one-hot [rows, max_loras] in the model's dtype,
    or None when no row uses an adapter (then the linears skip the side path)."""

    onehot: torch.Tensor | None = None


class LinearLoRA:
    """The slots of one linear; called after the base kernel: y += side path of x."""

    def __init__(self, linear: Linear, batch: LoRABatch, config: LoRAConfig, dtype) -> None:
        self.batch = batch
        self.rank = config.max_lora_rank
        self.out_sizes = linear.out_sizes
        self.width = len(linear.out_sizes) * self.rank  # columns of one slot
        size = config.max_loras * self.width
        self.a = torch.zeros(linear.in_features, size, dtype=dtype)
        self.b = torch.zeros(size, linear.out_features, dtype=dtype)

    def set_slot(self, slot: int, shards: dict[int, LoRAPair]) -> None:
        """Slot `slot` holds these shards' pairs (shard → (A [r, in], B [out_s, r], scaling));
        shards an adapter does not target stay zero."""
        first = slot * self.width
        self.a[:, first : first + self.width] = 0
        self.b[first : first + self.width] = 0
        for shard, (a, b, scaling) in shards.items():
            rank = a.shape[0]
            cols = slice(first + shard * self.rank, first + shard * self.rank + rank)
            out_start = sum(self.out_sizes[:shard])
            self.a[:, cols] = a.T.to(self.a.dtype)
            self.b[cols, out_start : out_start + self.out_sizes[shard]] = (b.T * scaling).to(
                self.b.dtype
            )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        onehot = self.batch.onehot
        if onehot is None:
            return y
        h = x @ self.a  # [T, max_loras * width]
        h.view(h.shape[0], onehot.shape[1], self.width).mul_(onehot.unsqueeze(-1))
        return y.addmm_(h, self.b)
