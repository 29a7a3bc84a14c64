"""Linears and embeddings that run on GGUF blocks as they are in the file (weight-only: the
activations stay fp32), through the native kernels of model/native/quant_matmul.c.

A decode-sized batch (<= QUANT_GEMV_MAX_ROWS rows) runs the block kernel, which reads each weight
block once for all rows: a Q4_1 weight streams 0.625 bytes per value instead of fp32's 4. A
larger batch (prefill) is compute-bound: its weight is dequantized chunk by chunk into the
model's reused DequantBuffer and multiplied by a GEMM, so no dense copy is ever kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from tokenbus.model.native import QUANT_GEMV_MAX_ROWS, QuantKernels
from tokenbus.model.native import ops as native_ops


class QuantizedWeight(Protocol):
    """One matrix in GGUF blocks (the loader's QuantizedWeight satisfies it)."""

    qtype: int  # gguf.GGMLQuantizationType value
    data: torch.Tensor  # uint8 [rows, row_bytes], contiguous
    cols: int  # values per row

    @property
    def rows(self) -> int: ...


def is_quantized(tensor: object) -> bool:
    return not isinstance(tensor, torch.Tensor)


def merge_shards(shards: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """Stack neighbouring shards of the same type (q/k/v, gate/up usually are): one kernel call
    (one OpenMP region) per linear instead of one per shard. A decode step made 211 calls of
    ~58 us each before; the rows are copied once, the originals dropped."""
    merged: list[list[QuantizedWeight]] = []
    for shard in shards:
        if merged and merged[-1][0].qtype == shard.qtype and merged[-1][0].cols == shard.cols:
            merged[-1].append(shard)
        else:
            merged.append([shard])
    # replace(): the loader's own frozen dataclass, with the stacked blocks.
    return [group[0] if len(group) == 1 else dataclasses.replace(group[0], data=torch.cat([s.data for s in group]))
            for group in merged]


class DequantBuffer:
    """The fp32 scratch that big-batch calls dequantize weights into: one per model (its
    linears run one at a time), reused, so a call does not page-fault a fresh buffer
    (benchmarks/quant_linear.py: 4.6x faster for the 49152x576 LM head; ~1.1x for a 3072x576
    layer weight, whose freed buffer the allocator mostly hands back anyway)."""

    MAX_VALUES = 4 << 20  # 16 MiB: bigger weights (a tied LM head) go in row chunks

    def __init__(self) -> None:
        self._data = torch.empty(0, dtype=torch.float32)

    def rows_per_chunk(self, cols: int) -> int:
        return max(1, self.MAX_VALUES // cols)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        if self._data.numel() < rows * cols:
            self._data = torch.empty(rows * cols, dtype=torch.float32)
        return self._data[: rows * cols].view(rows, cols)


class QuantizedLinearKernel:
    """x[..., K] -> [..., N] over shards of GGUF blocks stacked along N (fused q/k/v may mix
    types), plus an optional dense bias."""

    def __init__(self, kernels: QuantKernels, shards: Sequence[QuantizedWeight], bias: torch.Tensor | None,
                 buffer: DequantBuffer | None = None) -> None:
        self.kernels = kernels
        self.shards = merge_shards(shards)
        self.in_features = self.shards[0].cols
        self.out_features = sum(q.rows for q in self.shards)
        self.bias = bias
        self.buffer = buffer or DequantBuffer()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced(x)
        flat = x.reshape(-1, self.in_features).float().contiguous()  # [M, K]
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        if flat.shape[0] <= QUANT_GEMV_MAX_ROWS:
            start = 0
            for shard in self.shards:
                self.kernels.matmul(shard.qtype, shard.data, shard.cols, flat, out[:, start:start + shard.rows])
                start += shard.rows
        else:
            self._dequantize_and_multiply(flat, out)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _traced(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic through custom ops that torch.compile traces (native/ops.py)."""
        flat = x.reshape(-1, self.in_features).float()  # [M, K]
        parts = [native_ops.quant_matmul(flat, shard.data, shard.qtype, shard.cols) for shard in self.shards]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _dequantize_and_multiply(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Prefill-sized batches are compute-bound: a GEMM per chunk of dequantized rows."""
        start = 0
        for shard in self.shards:
            chunk = self.buffer.rows_per_chunk(shard.cols)
            for first in range(0, shard.rows, chunk):
                count = min(chunk, shard.rows - first)
                weight = self.kernels.dequant_rows(shard.qtype, shard.data, shard.cols,
                                                   torch.arange(first, first + count),
                                                   out=self.buffer.take(count, shard.cols))
                out[:, start + first: start + first + count] = flat @ weight.T
            start += shard.rows

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 [N, K] (a fresh tensor)."""
        parts = [self.kernels.dequant_rows(q.qtype, q.data, q.cols, torch.arange(q.rows)) for q in self.shards]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def quantized_embedding(kernels: QuantKernels, weight: QuantizedWeight, input_ids: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """Rows `input_ids` of a quantized embedding table as [T, hidden] in `dtype`."""
    if torch.compiler.is_compiling():
        return native_ops.dequant_rows(weight.data, weight.qtype, weight.cols, input_ids).to(dtype)
    rows = kernels.dequant_rows(weight.qtype, weight.data, weight.cols, input_ids.to(torch.int64).contiguous())
    return rows.to(dtype)
