"""The GGUF-block kernels (quant_matmul.c, quant_tiles.c), through ctypes."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbus.model.native.build import load_library
from tokenbus.model.native.signatures import bind
from tokenbus.utils.cpu import CpuFeatures

_QUANT_SOURCE = Path(__file__).with_name("quant_matmul.c")
_TILE_SOURCE = Path(__file__).with_name("quant_tiles.c")
# Largest activation batch quant_matmul takes (MAX_M in quant_matmul.c).
QUANT_MAX_ROWS = 64
# Rows up to which the block kernel beats dequantize + GEMM, at SmolLM2's shapes:
# benchmarks/quant_linear.py decides this threshold.
QUANT_GEMV_MAX_ROWS = min(16, QUANT_MAX_ROWS)
# Likewise on 16-row tiles with int16 activations: they win at every size the kernel takes
# (benchmarks/quant_linear.py --step --rows 64 checks it against dequantize + GEMM).
TILE_GEMV_MAX_ROWS = QUANT_MAX_ROWS


# gguf's GGMLQuantizationType F16 and BF16: matrices the kernels take as the file's 16-bit floats,
# whose tiles take x as fp32 at any number of rows (quant_tiles.c's tiles_half.h).
HALF_QTYPES = (1, 30)
# Rows per tile of quant_tiles.c (which GGML types it repacks, and into which format: its
# tile_format).
TILE_ROWS = 16
# How quant_tiles.c takes the activations (its ACT_*): as they are, rounded per 32 values (int8,
# int16), rounded to bf16, or to int8 per 256 values (q8_k: llama.cpp's Q8_K).
TILE_ACTIVATIONS = {"fp32": 0, "int8": 1, "int16": 2, "bf16": 3, "q8_k": 4}
# What quant_tiles.c's tile_bf16_engine() answers: how "bf16" activations run (none, AVX512-BF16
# dot products, AMX tiles).
BF16_ENGINES = ("", "avx512_bf16", "amx")


@dataclass(frozen=True)
class QuantKernels:
    """GGUF-block kernels: on W in GGUF rows, uint8 [N, row_bytes] (quant_matmul.c: every
    kernel type, weight-only), and on W repacked in 16-row tiles, uint8 [ceil(N / 16),
    tile_bytes] (quant_tiles.c: Q8_0/Q4_0/Q4_1/Q4_K/Q6_K, fp32, int8, int16 or bf16 activations)."""

    matmul_fn: ctypes._CFuncPtr
    dequant_fn: ctypes._CFuncPtr
    tile_fns: dict[str, ctypes._CFuncPtr] | None  # None: this CPU has no tiled kernels
    bf16_engine: str = (
        ""  # what runs tile_matmul's "bf16" activations here (BF16_ENGINES; "": none)
    )
    isa: str = (
        ""  # the vector level the kernels were built for (CpuFeatures.isa: avx512, avx2, baseline)
    )
    q8_k: bool = False  # whether tile_matmul takes "q8_k" activations here (AVX-512 VNNI)

    def tiles(self, qtype: int) -> bool:
        """Whether weights of this GGML type are repacked in tiles here."""
        return self.tile_fns is not None and self.tile_fns["format"](qtype) >= 0

    def tile_format(self, qtype: int) -> int:
        """The GGML type whose tile format holds W of type `qtype` once repacked (its own, or
        Q6_K for Q3_K): the qtype the tile kernels then take."""
        assert self.tiles(qtype)
        return self.tile_fns["format"](qtype)

    def super_block(self, tile_format: int) -> bool:
        """Whether a tile format is in 256-value super-blocks (the K-quants): the calls that
        TileModes.k_quant_from_rows moves to their own mode, as decode_layer.c's
        k_activations."""
        return self.tile_fns is not None and bool(self.tile_fns["super_block"](tile_format))

    def repack_tiles(
        self, qtype: int, w: torch.Tensor | Sequence[torch.Tensor], num_cols: int
    ) -> torch.Tensor:
        """W in GGUF rows -> a new uint8 [ceil(N / 16), tile_bytes] in 16-row tiles of
        tile_format(qtype). W may come in parts stacked along N (fused q/k/v): each part is
        repacked straight into its tiles, with no stacked copy of the blocks first; every part
        but the last must then have a multiple of 16 rows (a part's tiles start a tile)."""
        parts = [w] if isinstance(w, torch.Tensor) else list(w)
        assert self.tiles(qtype)
        assert all(p.dtype == torch.uint8 and p.is_contiguous() for p in parts)
        assert all(p.shape[0] % TILE_ROWS == 0 for p in parts[:-1])
        rows = sum(p.shape[0] for p in parts)
        nbytes = self.tile_fns["nbytes"](qtype, rows, num_cols)
        num_tiles = -(-rows // TILE_ROWS)
        out = torch.empty(num_tiles, nbytes // num_tiles, dtype=torch.uint8)
        first = 0
        for part in parts:
            status = self.tile_fns["repack"](
                qtype, part.data_ptr(), part.shape[0], num_cols, out[first // TILE_ROWS].data_ptr()
            )
            if status != 0:
                raise ValueError(
                    f"tile_repack: GGML type {qtype} with {num_cols} columns is not supported"
                )
            first += part.shape[0]
        return out

    def tile_matmul(
        self,
        qtype: int,
        tiles: torch.Tensor,
        num_rows: int,
        num_cols: int,
        x: torch.Tensor,
        out: torch.Tensor,
        activations: str,
    ) -> None:
        """out[M, N] (row-strided) = x[M, K] @ W.T, W tiled (num_rows = N); `activations`
        (TILE_ACTIVATIONS) int8 / int16 round x per 32-value block first (any M), q8_k rounds x
        to int8 per 256 values (any M; where `q8_k`), bf16 rounds x and W to bf16 (any M; where
        `bf16_engine`: AMX tiles or AVX512-BF16 dot products), fp32 takes up to QUANT_MAX_ROWS
        rows (quant_tiles.c); F16 and BF16 tiles take x as fp32 in every mode but bf16, at any
        M."""
        assert (
            tiles.dtype == torch.uint8
            and tiles.is_contiguous()
            and x.dtype == out.dtype == torch.float32
        )
        assert (
            x.stride(1) == 1
            and out.stride(1) == 1
            and (x.shape[0] <= QUANT_MAX_ROWS or activations != "fp32" or qtype in HALF_QTYPES)
        )
        assert x.shape[1] == num_cols and out.shape == (x.shape[0], num_rows)
        assert tiles.numel() == self.tile_fns["nbytes"](qtype, num_rows, num_cols), (
            "tiles of another shape"
        )
        status = self.tile_fns["matmul"](
            qtype,
            tiles.data_ptr(),
            num_rows,
            num_cols,
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            TILE_ACTIVATIONS[activations],
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"tile_matmul: GGML type {qtype} with {num_cols} columns is not supported"
            )

    def tile_dequant_rows(
        self, qtype: int, tiles: torch.Tensor, num_rows: int, num_cols: int, rows: torch.Tensor
    ) -> torch.Tensor:
        """fp32 [len(rows), K]: the given rows (int64 ids) of a tiled W."""
        assert rows.dtype == torch.int64 and rows.is_contiguous()
        out = torch.empty(rows.numel(), num_cols, dtype=torch.float32)
        status = self.tile_fns["dequant_rows"](
            qtype,
            tiles.data_ptr(),
            num_rows,
            num_cols,
            rows.data_ptr(),
            rows.numel(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"tile_dequant_rows: GGML type {qtype} with {num_cols} columns is not supported"
            )
        return out

    def tile_dequant_t(
        self,
        qtype: int,
        tiles: torch.Tensor,
        num_rows: int,
        num_cols: int,
        first_tile: int,
        out: torch.Tensor,
    ) -> None:
        """out [K, 16 * count] (row-strided) = W^T of tiles [first_tile, first_tile + count)."""
        assert out.dtype == torch.float32 and out.stride(1) == 1 and out.shape[0] == num_cols
        assert out.shape[1] % TILE_ROWS == 0
        status = self.tile_fns["dequant_t"](
            qtype,
            tiles.data_ptr(),
            num_rows,
            num_cols,
            first_tile,
            out.shape[1] // TILE_ROWS,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"tile_dequant_t: GGML type {qtype} with {num_cols} columns is not supported"
            )

    def matmul(
        self, qtype: int, w: torch.Tensor, num_cols: int, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out[M, N] (row-strided, may be a column slice of a wider tensor) = x[M, K] @ W.T."""
        assert (
            w.dtype == torch.uint8 and w.is_contiguous() and x.dtype == out.dtype == torch.float32
        )
        assert x.stride(1) == 1 and out.stride(1) == 1 and x.shape[0] <= QUANT_MAX_ROWS
        status = self.matmul_fn(
            qtype,
            w.data_ptr(),
            w.shape[0],
            num_cols,
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"quant_matmul: GGML type {qtype} with {num_cols} columns is not supported"
            )

    def dequant_rows(
        self,
        qtype: int,
        w: torch.Tensor,
        num_cols: int,
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 [len(rows), K]: the given rows of W (int64 row ids), into `out` if given."""
        assert (
            w.dtype == torch.uint8
            and w.is_contiguous()
            and rows.dtype == torch.int64
            and rows.is_contiguous()
        )
        if out is None:
            out = torch.empty(rows.numel(), num_cols, dtype=torch.float32)
        assert (
            out.dtype == torch.float32
            and out.is_contiguous()
            and out.shape == (rows.numel(), num_cols)
        )
        status = self.dequant_fn(
            qtype,
            w.data_ptr(),
            num_cols,
            rows.data_ptr(),
            rows.numel(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"quant_dequant_rows: GGML type {qtype} with {num_cols} columns is not supported"
            )
        return out


def load_quant_kernels(
    cpu: CpuFeatures | None = None, tile_source: Path = _TILE_SOURCE
) -> QuantKernels:
    """Build (or find in the cache) and load the quantized kernels; NativeBuildError says why not.
    `tile_source`: another quant_tiles.c (with its headers beside it), for a benchmark to time a
    kernel change against the build before it in one process (benchmarks/quant_linear.py)."""
    lib = load_library(_QUANT_SOURCE, cpu)
    matmul, dequant = bind(lib, "quant_matmul"), bind(lib, "quant_dequant_rows")
    tile_fns = _load_tile_fns(cpu, tile_source)
    engine = BF16_ENGINES[tile_fns["bf16_engine"]()] if tile_fns is not None else ""
    return QuantKernels(
        matmul,
        dequant,
        tile_fns,
        bf16_engine=engine,
        isa=(cpu or CpuFeatures.detect()).isa,
        q8_k=tile_fns is not None and bool(tile_fns["q8_k"]()),
    )


def _load_tile_fns(cpu: CpuFeatures | None, source: Path) -> dict[str, ctypes._CFuncPtr] | None:
    """quant_tiles.c's entry points, or None where this CPU has no tiled kernels (below AVX2)."""
    lib = load_library(source, cpu)
    if not bind(lib, "tile_supported")():
        return None
    return {
        key: bind(lib, f"tile_{key}")
        for key in (
            "nbytes",
            "repack",
            "matmul",
            "dequant_rows",
            "dequant_t",
            "bf16_engine",
            "q8_k",
            "format",
            "super_block",
        )
    }
