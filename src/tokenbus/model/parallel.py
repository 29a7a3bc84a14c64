"""Tensor parallelism for the Llama family: which slice of each weight a rank holds, and the
two collectives that join the slices (L2).

A rank of `size` holds (Megatron layout, as in vLLM):
- query heads [r*Hq/size, (r+1)*Hq/size) and KV heads from r*Hkv//size: Hkv/size of them when
  size <= Hkv, else one, replicated over size/Hkv ranks. Both rules pick the KV head of every
  local query head (query head h uses KV head h // (Hq/Hkv));
- the matching columns of o_proj (row-parallel: partial sums, then all-reduce);
- intermediate columns [r*I/size, ...) of gate/up, the matching rows of down (all-reduce);
- vocabulary rows [r*Vp/size, ...) of the embedding and LM head, Vp = V padded to a multiple
  of size (padding rows are zero): embedding lookups outside the slice give 0, then all-reduce;
  LM-head logits are all-gathered, so every rank samples the same tokens from the same logits.

The process group is passed in (never a module global); size 1 needs no torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from tokenbus.model_arch import ModelArch
from tokenbus.utils import cdiv


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place (every rank gets the same bits)."""
        if self.enabled:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank order along the last dim."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ this rank's slices
    def check_divides(self, arch: ModelArch) -> None:
        """The split must be exact: a clear error naming the flag, before any weight loads."""
        n = self.size
        if n == 1:
            return
        q, inter = arch.num_attention_heads, arch.intermediate_size
        kv_heads = sorted({arch.num_key_value_heads, *(h for h, _ in arch.layer_kv_shapes)})
        uneven = [kv for kv in kv_heads if ((kv % n) if n <= kv else (n % kv))]
        problem = None
        if q % n:
            problem = f"the {q} attention heads"
        elif uneven:
            problem = f"the {uneven[0]} KV heads (need size | KV heads, or KV heads | size)"
        elif inter % n:
            problem = f"the intermediate size {inter}"
        if problem:
            raise ValueError(f"tensor_parallel_size={n} does not divide {problem} of this model")

    def shard_arch(self, arch: ModelArch) -> ModelArch:
        """The per-rank shape: local heads and MLP width (vocab stays whole: the sampler's)."""
        if self.size == 1:
            return arch
        return dataclasses.replace(
            arch,
            num_attention_heads=arch.num_attention_heads // self.size,
            num_key_value_heads=max(1, arch.num_key_value_heads // self.size),
            intermediate_size=arch.intermediate_size // self.size,
            layer_kv_shapes=tuple(
                (max(1, heads // self.size), dim) for heads, dim in arch.layer_kv_shapes
            ),
        )

    def kv_head_start(self, num_kv_heads: int) -> int:
        return self.rank * num_kv_heads // self.size

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """[start, start + per_rank) of the padded vocabulary this rank holds."""
        per_rank = cdiv(vocab_size, self.size)
        return self.rank * per_rank, per_rank


SINGLE = TensorParallel()
