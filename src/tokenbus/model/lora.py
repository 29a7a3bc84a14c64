"""LoRA adapters as a low-rank side path of the linears (L2).

A request's adapter adds `scaling · (x Aᵀ) Bᵀ` to each linear it targets. Adapters are never
merged into the base weights (which may be GGUF blocks): every linear keeps `max_loras` slots,
a [max_loras · W, in] (each slot's A, zero-padded to W rows) and b [max_loras · W, out] (each
slot's scaling · Bᵀ), and a step adds the side path of each adapter to its rows at once:

    y[rows of slot s] += (x[rows of slot s] @ a_sᵀ) @ b_s

Two GEMMs per adapter in the step, not a loop over requests (the worker orders a step's
requests by adapter, so each adapter's rows are a slice or two). For a fused linear (q/k/v,
gate/up) a slot is W = shards · max_lora_rank rows: shard s's rows [s · R, s · R + r) of a slot
hold that shard's A, and the same rows of b its Bᵀ under the shard's output columns
(block-diagonal), so one pair of GEMMs serves all shards. Decode-sized steps in C
(native/decode_layer.c) read the same slots, row by row (lora_add).

worker/lora_slots.py decides which adapter sits in which slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


Rows = slice | torch.Tensor  # a step's rows: a range, or int64 indices


@dataclass
class LoRABatch:
    """Which rows of this step use which slot: (slot, rows) per adapter in the step (torch), and
    each row's slot [rows] int64, -1 for none (C); empty and None when no row uses an adapter
    (then the linears skip the side path)."""

    groups: list[tuple[int, Rows]] = field(default_factory=list)
    slots: torch.Tensor | None = None


class LinearLoRA:
    """The slots of one linear; called after the base kernel: y += side path of x."""

    def __init__(
        self,
        linear: Linear,
        batch: LoRABatch,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.batch = batch
        self.rank = config.max_lora_rank
        self.out_sizes = linear.out_sizes
        self.width = len(linear.out_sizes) * self.rank  # columns of one slot
        size = config.max_loras * self.width
        # On the model's device: the side path multiplies the step's activations.
        self.a = torch.zeros(size, linear.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(size, linear.out_features, dtype=dtype, device=device)

    def set_slot(self, slot: int, shards: dict[int, LoRAPair]) -> None:
        """Slot `slot` holds these shards' pairs (shard → (A [r, in], B [out_s, r], scaling));
        shards an adapter does not target stay zero."""
        first = slot * self.width
        self.a[first : first + self.width] = 0
        self.b[first : first + self.width] = 0
        for shard, (a, b, scaling) in shards.items():
            rank = a.shape[0]
            rows = slice(first + shard * self.rank, first + shard * self.rank + rank)
            out_start = sum(self.out_sizes[:shard])
            self.a[rows] = a.to(self.a.dtype)
            self.b[rows, out_start : out_start + self.out_sizes[shard]] = (b.T * scaling).to(
                self.b.dtype
            )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, rows in self.batch.groups:
            a = self.a[slot * self.width : (slot + 1) * self.width]  # [W, in]
            b = self.b[slot * self.width : (slot + 1) * self.width]  # [W, out]
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ a.T, b)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b)
        return y
