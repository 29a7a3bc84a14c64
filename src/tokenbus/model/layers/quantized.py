"""Linears and embeddings that run on GGUF blocks as they are in the file (weight-only: the
activations stay fp32), through the native kernels of model/native/quant_matmul.c.

A decode-sized batch (<= QUANT_GEMV_MAX_ROWS rows) runs the block kernel, which reads each weight
block once for all rows: a Q4_1 weight streams 0.625 bytes per value instead of fp32's 4. A
larger batch (prefill) is compute-bound: its weight is dequantized for the call and multiplied
by a GEMM, then dropped, so no dense copy is ever kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from tokenbus.model.native import QUANT_MAX_ROWS, QuantKernels

# Rows up to which the block kernel beats dequantize + GEMM (measured on the 2-core CPU at
# SmolLM2's shapes, benchmarks/quant_linear.py).
QUANT_GEMV_MAX_ROWS = min(16, QUANT_MAX_ROWS)


class QuantizedWeight(Protocol):
    """One matrix in GGUF blocks (the loader's QuantizedWeight satisfies it)."""

    qtype: int  # gguf.GGMLQuantizationType value
    data: torch.Tensor  # uint8 [rows, row_bytes], contiguous
    cols: int  # values per row

    @property
    def rows(self) -> int: ...


def is_quantized(tensor: object) -> bool:
    return not isinstance(tensor, torch.Tensor)


class QuantizedLinearKernel:
    """x[..., K] -> [..., N] over shards of GGUF blocks stacked along N (fused q/k/v may mix
    types), plus an optional dense bias."""

    def __init__(self, kernels: QuantKernels, shards: Sequence[QuantizedWeight], bias: torch.Tensor | None) -> None:
        self.kernels = kernels
        self.shards = list(shards)
        self.in_features = self.shards[0].cols
        self.out_features = sum(q.rows for q in self.shards)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()  # [M, K]
        if flat.shape[0] <= QUANT_GEMV_MAX_ROWS:
            out = torch.empty(flat.shape[0], self.out_features)
            start = 0
            for shard in self.shards:
                self.kernels.matmul(shard.qtype, shard.data, shard.cols, flat, out[:, start:start + shard.rows])
                start += shard.rows
            if self.bias is not None:
                out += self.bias
        else:
            out = F.linear(flat, self.dequantize(), self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 [N, K] (transient)."""
        parts = [self.kernels.dequant_rows(q.qtype, q.data, q.cols, torch.arange(q.rows)) for q in self.shards]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def quantized_embedding(kernels: QuantKernels, weight: QuantizedWeight, input_ids: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """Rows `input_ids` of a quantized embedding table as [T, hidden] in `dtype`."""
    rows = kernels.dequant_rows(weight.qtype, weight.data, weight.cols, input_ids.to(torch.int64).contiguous())
    return rows.to(dtype)
