"""Linears and embeddings that run on GGUF blocks, through the native kernels of
model/native: matrices of every kernel type but Q2_K (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
MXFP4, the other K-quants, IQ4_XS; F16 and BF16, whose values are the file's floats) are repacked
once into 16-row tiles (quant_tiles.c: their quants interleaved so one vector instruction serves
16 outputs) where the CPU has AVX2; Q2_K, and every type on older CPUs, stay in GGUF rows
(quant_matmul.c).

A decode-sized batch (<= QUANT_GEMV_MAX_ROWS rows, TILE_GEMV_MAX_ROWS on tiles) runs the block
kernel, which reads each weight block once for all rows: a Q4_1 weight streams 0.625 bytes per
value instead of fp32's 4. On tiles its activations are fp32 (weight-only: equal to
dequantize-then-matmul up to rounding), or rounded per 32 values to int16 (integer dot
products, the default: faster than fp32 tiles and GGUF rows while logprobs stay close to fp32's;
benchmarks/quant_linear.py --step and benchmarks/activation_error.py measure both), or to int8
(llama.cpp's approach: a little faster, but ~1/254 of a block's largest value per activation,
which a model's many matmuls compound into greedy answers that differ from the model's:
benchmarks/activation_error.py). A larger batch (a long prefill chunk) is
compute-bound: its weight is dequantized chunk by chunk into the model's reused DequantBuffer
and multiplied by an fp32 GEMM, so no dense copy is ever kept; on AVX2 and AVX-512 CPUs
without a bf16 engine, under quant_activations=auto, it stays on integer tiles instead (faster
there: GEMM_FROM_ROWS; int16, or int8 for AVX2's K-quant calls, below).

On a CPU with AVX512-BF16, calls from BF16_AUTO_MIN_ROWS rows up (prefill chunks, and on AMX
decode batches of 16+) take bf16 activations instead, at any size: each weight tile is
dequantized once per call into bf16, x is rounded to bf16, and AMX tiles (or, without AMX,
vdpbf16ps) sum the products in fp32 (quant_tiles.c). benchmarks/quant_linear.py --step compares
them with int16 tiles and with the fp32 GEMM. Without AMX but with AVX-512 VNNI, calls on
K-quant tiles from Q8_K_AUTO_MIN_ROWS rows (prefill chunks, decode batches of 16+) take q8_k
activations instead: x rounded to int8 per 256 values (llama.cpp's Q8_K) and integer dot
products, at twice vdpbf16ps's multiply-adds per instruction (quant_tiles.c's tiles_q8k.h). On
AVX2 (INT8_K_QUANT_ISAS), the same calls take int8 activations (per 32 values).

Every mode above is row-local (a row's result is the same whatever other rows share the call:
tests/model/test_batch_invariant.py), but which mode and kernel a call takes depends on its
rows, so a token's numbers change with the size of its step. --batch-invariant fixes the mode
and keeps every call on the block kernels (TileModes.row_invariant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tokenbus.model.native import (
    HALF_QTYPES,
    QUANT_GEMV_MAX_ROWS,
    QUANT_MAX_ROWS,
    TILE_GEMV_MAX_ROWS,
    TILE_ROWS,
    QuantKernels,
)

# From how many rows a call on tiles takes bf16 activations under quant_activations=auto, per
# bf16 engine (QuantKernels.bf16_engine): where bf16 overtakes int16 tiles, below which int16's
# numerics, closer to fp32, are kept. benchmarks/quant_linear.py --step (int16 vs bf16 rows)
# decides each threshold.
BF16_AUTO_MIN_ROWS = {"amx": 16, "avx512_bf16": 32}
# From how many rows a call on tiles takes q8_k activations (int8 per 256 values) under
# quant_activations=auto, on K-quant tiles, where the kernels have them (AVX-512 VNNI) and no AMX
# takes bf16: prefill chunks and decode batches of 16+ (as AMX's bf16), where its integer dots
# beat vdpbf16ps and int16's vpdpwssd; smaller decode steps keep int16's numerics.
Q8_K_AUTO_MIN_ROWS = 16
# On these tile ISAs, where the kernels have neither q8_k nor a bf16 engine (AVX2: AMD Zen 3,
# Intel Haswell to Comet Lake), the same K-quant calls (from Q8_K_AUTO_MIN_ROWS rows) take int8
# instead: x rounded per 32 values (llama.cpp's Q8_0 activations; finer than the Q8_K that
# llama.cpp pairs with these weights), whose vpmaddubsw does twice vpmaddwd's multiply-adds an
# instruction. On an AVX2 EPYC a 1B Q4_K_M file prefills 1.6x faster than on int16
# (docs/benchmarks.md), and a decode step's linears at 8, 16 and 32 rows ran 1.4-1.5x faster
# (benchmarks/quant_linear.py --step --kernels int8 int16, the default model's shapes);
# single-token decode steps keep int16, faster there and closer to fp32.
INT8_K_QUANT_ISAS = ("avx2",)

# Where no bf16 engine takes the big calls, from how many rows a call on tiles dequantizes its
# weight for an fp32 GEMM instead (quant_activations=auto): past the decode-sized calls, except
# on the tile ISAs listed here, where integer activations stay ahead of the GEMM at any size
# (quant_tiles.c takes MAX_M rows at a time per tile); benchmarks/quant_linear.py --step --rows
# 64 256 2048 decides which ISAs belong. With VNNI an int16 multiply-add is one vpdpwssd
# instead of two instructions.
GEMM_FROM_ROWS = TILE_GEMV_MAX_ROWS + 1
INT_TILES_ANY_ROWS_ISAS = ("avx2", "avx512")


@dataclass(frozen=True)
class TileModes:
    """How calls on tiles take x, by their number of rows (model/kernel_plan.py's
    quant_activation_modes chooses them): bf16 from `bf16_from_rows` rows up
    (0: never), else dequantized for an fp32 GEMM from `gemm_from_rows` rows up (0: never), else
    `activations` (fp32 | int16 | int8; fp32 tiles take at most TILE_GEMV_MAX_ROWS rows, beyond
    that shard_matmul runs the GEMM).

    `row_invariant` (--batch-invariant): every call runs the block kernels, whose rows never
    depend on each other, in slices of QUANT_MAX_ROWS rows where a kernel takes no more, and
    never the GEMM (whose sums for a row change with the call's number of rows); the modes
    must then not depend on the rows either (bf16_from_rows 0 or 1, gemm_from_rows 0)."""

    activations: str = "fp32"
    bf16_from_rows: int = 0
    gemm_from_rows: int = GEMM_FROM_ROWS
    row_invariant: bool = False
    # From this many rows (0: never), calls on K-quant tiles (KernelWeight.super_block) take
    # `k_quant_activations` (q8_k: the activations llama.cpp pairs with K-quants); the other
    # types' calls keep the modes above.
    k_quant_from_rows: int = 0
    k_quant_activations: str = "q8_k"

    def mode(self, rows: int, k_quant: bool = False) -> str:
        """The mode of a call of `rows` rows (on K-quant tiles where `k_quant`): shard_matmul's
        `mode`."""
        if self.k_quant_from_rows and rows >= self.k_quant_from_rows and k_quant:
            return self.k_quant_activations
        if self.bf16_from_rows and rows >= self.bf16_from_rows:
            return "bf16"
        return "gemm" if self.gemm_from_rows and rows >= self.gemm_from_rows else self.activations


class QuantizedWeight(Protocol):
    """One matrix in GGUF blocks (the loader's QuantizedWeight satisfies it)."""

    qtype: int  # gguf.GGMLQuantizationType value
    data: torch.Tensor  # uint8 [rows, row_bytes], contiguous
    cols: int  # values per row

    @property
    def rows(self) -> int: ...


@dataclass(frozen=True)
class KernelWeight:
    """A GGUF matrix as the kernels hold it: in GGUF rows (uint8 [rows, row_bytes]) or, when
    `tiled`, in quant_tiles.c's 16-row tiles (uint8 [ceil(rows / 16), tile_bytes]: the same
    bytes for the 32-value types, 3% more for Q4_K and 30% more for Q6_K, whose 6-bit quants
    become bytes: QuantKernels.repack_tiles)."""

    qtype: int  # when tiled: its tile format (QuantKernels.tile_format), which the kernels take
    data: torch.Tensor
    cols: int
    rows: int
    tiled: bool = False
    # Tiled in 256-value super-blocks (a K-quant, QuantKernels.super_block): its calls take
    # the K-quant activation mode (TileModes.mode).
    super_block: bool = False


def kernel_weight(
    kernels: QuantKernels, weight: QuantizedWeight | Sequence[QuantizedWeight]
) -> KernelWeight:
    """`weight` (or shards of one type stacked along N, in order) repacked in tiles where its
    type has tiled kernels here, else as it is (shards stacked: one copy). Tiles are written shard
    by shard, so the GGUF blocks (pages of the file, as the loader maps them) are read once and
    never copied."""
    if isinstance(weight, KernelWeight):
        return weight
    parts = list(weight) if isinstance(weight, Sequence) else [weight]
    first, rows = parts[0], sum(p.rows for p in parts)
    if not kernels.tiles(first.qtype):
        data = first.data if len(parts) == 1 else torch.cat([p.data for p in parts])
        return KernelWeight(first.qtype, data, first.cols, rows)
    blocks = [p.data for p in parts]
    if any(p.rows % TILE_ROWS for p in parts[:-1]):  # a shard's tiles must start a tile
        blocks = [torch.cat(blocks)]
    tile_format = kernels.tile_format(first.qtype)
    return KernelWeight(
        tile_format,
        kernels.repack_tiles(first.qtype, blocks, first.cols),
        first.cols,
        rows,
        tiled=True,
        super_block=kernels.super_block(tile_format),
    )


def is_quantized(tensor: object) -> bool:
    return not isinstance(tensor, torch.Tensor)


def holds_floats(tensor: object) -> bool:
    """Whether a checkpoint tensor is floats: a dense tensor, or a GGUF matrix of a half type
    (what --quantization q8_0 rounds to Q8_0, as it does a safetensors file's)."""
    return not is_quantized(tensor) or tensor.qtype in HALF_QTYPES


def dense(tensor) -> torch.Tensor:
    """An fp32 tensor of a checkpoint tensor, or of a GGUF matrix's blocks."""
    if not is_quantized(tensor):
        return tensor
    from gguf import GGMLQuantizationType  # lazy: only GGUF models read it
    from gguf.quants import dequantize

    blocks = tensor.data.numpy()
    return torch.from_numpy(
        np.ascontiguousarray(dequantize(blocks, GGMLQuantizationType(tensor.qtype)))
    )


def group_shards(shards: Sequence[QuantizedWeight]) -> list[list[QuantizedWeight]]:
    """Neighbouring shards of the same type (q/k/v, gate/up usually are), to be stacked into one
    weight (kernel_weight): one kernel call (one OpenMP region) per linear instead of one per
    shard, each call paying a region's start-up."""
    groups: list[list[QuantizedWeight]] = []
    for shard in shards:
        if groups and groups[-1][0].qtype == shard.qtype and groups[-1][0].cols == shard.cols:
            groups[-1].append(shard)
        else:
            groups.append([shard])
    return groups


class DequantBuffer:
    """The fp32 scratch that big-batch calls dequantize weights into: one per model (its
    linears run one at a time), reused, so a call does not page-fault a fresh buffer
    (benchmarks/quant_linear.py compares fresh and reused: it pays most for the large LM head;
    a layer weight's freed buffer the allocator mostly hands back anyway)."""

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
    types), plus an optional dense bias. How tiled shards take x: `modes` (set by the kernel
    plan: model/kernel_plan.apply_kernels)."""

    def __init__(
        self,
        kernels: QuantKernels,
        shards: Sequence[QuantizedWeight],
        bias: torch.Tensor | None,
        buffer: DequantBuffer | None = None,
    ) -> None:
        self.kernels = kernels
        self.shards = [kernel_weight(kernels, group) for group in group_shards(shards)]
        self.in_features = self.shards[0].cols
        self.out_features = sum(q.rows for q in self.shards)
        self.bias = bias
        self.buffer = buffer or DequantBuffer()
        self.modes = TileModes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()  # [M, K]
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        start = 0
        for shard in self.shards:
            shard_matmul(
                self.kernels,
                shard,
                flat,
                out[:, start : start + shard.rows],
                self.modes.mode(flat.shape[0], shard.super_block),
                self.buffer,
                self.modes.row_invariant,
            )
            start += shard.rows
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 [N, K] (a fresh tensor)."""
        parts = [dequantize_weight(self.kernels, q) for q in self.shards]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def shard_matmul(
    kernels: QuantKernels,
    shard: KernelWeight,
    flat: torch.Tensor,
    out: torch.Tensor,
    mode: str,
    buffer: DequantBuffer,
    row_invariant: bool = False,
) -> None:
    """out [M, rows] (a column slice) = flat [M, K] @ shard.T: on tiles the block kernel in
    `mode` (TileModes.mode; fp32 up to TILE_GEMV_MAX_ROWS rows; F16 and BF16 tiles at any size,
    x as fp32 but in bf16 mode), in GGUF rows the block kernel up to QUANT_GEMV_MAX_ROWS;
    otherwise a GEMM per chunk of dequantized rows (of W^T, whole tiles, when tiled).
    `row_invariant`: the block kernels at any size (TileModes.row_invariant)."""
    tiled, num_rows = shard.tiled, flat.shape[0]
    if tiled and shard.qtype in HALF_QTYPES:
        # F16 / BF16 tiles: x as fp32 at any number of rows, each row on its own, ahead of the
        # GEMM on W^T at prefill sizes too (benchmarks/quant_linear.py --half); or, in bf16
        # mode, the bf16 engine's products of W and x rounded to bf16 (twice the FMA's rate).
        mode = "bf16" if mode == "bf16" else "fp32"
        kernels.tile_matmul(shard.qtype, shard.data, shard.rows, shard.cols, flat, out, mode)
        return
    if row_invariant and (not tiled or mode == "fp32") and num_rows > QUANT_MAX_ROWS:
        for first in range(0, num_rows, QUANT_MAX_ROWS):  # the most these kernels take
            rows = slice(first, first + QUANT_MAX_ROWS)
            shard_matmul(kernels, shard, flat[rows], out[rows], mode, buffer, row_invariant)
        return
    if tiled and mode != "gemm" and (mode != "fp32" or num_rows <= TILE_GEMV_MAX_ROWS):
        kernels.tile_matmul(shard.qtype, shard.data, shard.rows, shard.cols, flat, out, mode)
        return
    if not tiled and (num_rows <= QUANT_GEMV_MAX_ROWS or row_invariant):
        kernels.matmul(shard.qtype, shard.data, shard.cols, flat, out)
        return
    chunk = buffer.rows_per_chunk(shard.cols)
    if tiled:
        chunk = max(TILE_ROWS, chunk - chunk % TILE_ROWS)
    for first in range(0, shard.rows, chunk):
        count = min(chunk, shard.rows - first)
        if tiled:
            # [K, whole tiles' rows]
            weight_t = buffer.take(shard.cols, -(-count // TILE_ROWS) * TILE_ROWS)
            kernels.tile_dequant_t(
                shard.qtype, shard.data, shard.rows, shard.cols, first // TILE_ROWS, weight_t
            )
            out[:, first : first + count] = flat @ weight_t[:, :count]
        else:
            weight = kernels.dequant_rows(
                shard.qtype,
                shard.data,
                shard.cols,
                torch.arange(first, first + count),
                out=buffer.take(count, shard.cols),
            )
            out[:, first : first + count] = flat @ weight.T


def dequantize_weight(
    kernels: QuantKernels, weight: KernelWeight, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [len(rows), K]: rows (int64 ids; default all) of a weight in either layout."""
    rows = torch.arange(weight.rows) if rows is None else rows.to(torch.int64).contiguous()
    if weight.tiled:
        return kernels.tile_dequant_rows(weight.qtype, weight.data, weight.rows, weight.cols, rows)
    return kernels.dequant_rows(weight.qtype, weight.data, weight.cols, rows)


def quantized_embedding(
    kernels: QuantKernels, weight: QuantizedWeight, input_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `input_ids` of a quantized embedding table as [T, hidden] in `dtype`."""
    return dequantize_weight(kernels, weight, input_ids).to(dtype)
