"""Dense fp32 linears whose rows never depend on each other (dense_rows.c), for --batch-invariant.

oneDNN's and MKL's GEMMs choose their kernels by the number of rows, so the same token's output
changes with the size of its batch; dense_rows.c computes each output as one FMA chain over k in
order, at any number of rows. The weight is packed once into 16-row panels (a second copy, as
oneDNN's packed linears keep one).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbus.model.native import load_library
from tokenbus.model.native.signatures import bind
from tokenbus.utils.cpu import CpuFeatures

_SOURCE = Path(__file__).with_name("dense_rows.c")


@dataclass(frozen=True)
class DenseRowsKernel:
    """dense_rows.c's entry points."""

    panel_floats_fn: ctypes._CFuncPtr
    pack_fn: ctypes._CFuncPtr
    matmul_fn: ctypes._CFuncPtr

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W fp32 [N, K] -> its panels (a new fp32 tensor, dense_pack's layout)."""
        weight = weight.detach().contiguous()
        assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
        rows, cols = weight.shape
        out = torch.empty(self.panel_floats_fn(rows, cols), dtype=torch.float32)
        self.pack_fn(weight.data_ptr(), rows, cols, out.data_ptr())
        return out

    def matmul(self, panels: torch.Tensor, rows: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, rows] (row-strided) = x [M, K] (row-strided) @ W^T, W packed by `pack`."""
        assert x.dtype == out.dtype == torch.float32 and x.stride(1) == 1 and out.stride(1) == 1
        assert out.shape == (x.shape[0], rows) and panels.numel() == self.panel_floats_fn(
            rows, x.shape[1]
        )
        self.matmul_fn(
            panels.data_ptr(),
            rows,
            x.shape[1],
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )


@functools.cache
def load_dense_rows(cpu: CpuFeatures | None = None) -> DenseRowsKernel:
    """Build (or find in the cache) and load dense_rows.c; NativeBuildError says why not."""
    lib = load_library(_SOURCE, cpu)
    return DenseRowsKernel(
        *(bind(lib, name) for name in ("dense_panel_floats", "dense_pack", "dense_matmul"))
    )


class RowInvariantLinear:
    """x [..., K] -> x @ weight.T + bias [..., N] by dense_rows.c (weight fp32 [N, K] on CPU).
    `panels` is the packed weight, which decode_layer.c's routers read too."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.kernel = load_dense_rows()
        self.rows, self.cols = weight.shape
        self.panels = self.kernel.pack(weight)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.cols).contiguous()  # [M, K]
        out = torch.empty(flat.shape[0], self.rows, dtype=torch.float32)
        self.kernel.matmul(self.panels, self.rows, flat, out)
        if self.bias is not None:
            out += self.bias  # after the chain: one add per output, whatever the rows
        return out.reshape(*x.shape[:-1], self.rows)
