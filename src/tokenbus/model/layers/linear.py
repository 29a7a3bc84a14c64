"""Linear layers: weights load in HF layout, then run through a kernel picked per device.

On CPU a oneDNN weight pre-packed once with `torch.ops.mkldnn._reorder_linear_weight` runs
faster than both `F.linear(x, w)` and `torch.mm(x, w_t)` at decode and prefill sizes in fp32,
and in bf16 it avoids F.linear's slow path (benchmarks/decode_step.py --linear-backend decides
this). So on CPU every linear runs packed when oneDNN supports the dtype on this CPU (bf16
packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU runs bf16 through
`F.linear`); elsewhere (CUDA, fp16 on CPU) it runs `F.linear`. The dense weight stays the
source of truth (state_dict, `.to()`; re-run `finalize` after moving), at the cost of a second
copy in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from tokenbus.model import kv_quant
from tokenbus.model.layers.quantized import (
    DequantBuffer,
    KernelWeight,
    QuantizedLinearKernel,
    QuantizedWeight,
    dense,
    holds_floats,
    is_quantized,
)
from tokenbus.model.native import QuantKernels
from tokenbus.utils.cpu import CpuFeatures

# rows: dense_rows.c, every output one FMA chain whatever the batch (--batch-invariant)
LINEAR_BACKENDS = ("auto", "dense", "onednn", "rows")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

LinearKernel = Callable[[torch.Tensor], torch.Tensor]


def onednn_unsupported_reason(weight: torch.Tensor, cpu: CpuFeatures | None = None) -> str | None:
    """Why a packed oneDNN linear cannot run this weight here, or None when it can."""
    if weight.device.type != "cpu" or weight.dtype not in _ONEDNN_DTYPES:
        return (
            "packed oneDNN linears run on CPU in float32 or bfloat16, "
            f"not {weight.device.type} {weight.dtype}"
        )
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return "this torch build has no oneDNN"
    if weight.dtype == torch.bfloat16:
        missing = (cpu or CpuFeatures.detect()).missing_for_bf16_packed_linear()
        if missing:
            return (
                f"packed bfloat16 linears need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; "
                f"this CPU lacks {', '.join(missing)}"
            )
    return None


def choose_linear_backend(
    weight: torch.Tensor, backend: str = "auto", cpu: CpuFeatures | None = None
) -> str:
    """ "dense" or "onednn" for this weight here: `auto` packs for oneDNN where
    `onednn_unsupported_reason` allows; `onednn` where it cannot run is a ValueError with the
    reason."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend in ("dense", "rows"):
        if backend == "rows" and (weight.device.type, weight.dtype) != ("cpu", torch.float32):
            raise ValueError(
                f"linear backend 'rows' runs on CPU in float32, not {weight.device.type} "
                f"{weight.dtype}"
            )
        return backend
    reason = onednn_unsupported_reason(weight, cpu)
    if backend == "onednn" and reason is not None:
        raise ValueError(f"linear backend 'onednn': {reason}")
    return "dense" if reason is not None else "onednn"


def make_linear_kernel(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str = "auto",
    cpu: CpuFeatures | None = None,
) -> LinearKernel:
    """A callable x[..., in] -> [..., out] computing x @ weight.T + bias; weight is [out, in]."""
    chosen = choose_linear_backend(weight, backend, cpu)
    if chosen == "dense":
        return lambda x: F.linear(x, weight, bias)
    if chosen == "rows":
        from tokenbus.model.native.dense_rows import RowInvariantLinear

        return RowInvariantLinear(weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # opaque blocked layout
    packed_bias = None if bias is None else bias.detach()
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, packed_bias, "none", [], "")


class Linear(nn.Module):
    """y = x @ W.T + b where W stacks one or more shards (fused q/k/v, gate/up) along `out`.

    Shard i occupies output rows [offset_i, offset_i + out_sizes[i]). Until `finalize()` the
    layer runs `F.linear`; afterwards it runs the kernel chosen for its device and dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool = False,
        row_invariant: bool = False,
    ) -> None:
        super().__init__()
        # row_invariant: each row's output must not depend on the other rows (an MoE router,
        # whose logits choose experts): on CPU in fp32 it runs on dense_rows.c, whatever
        # backend the engine asked for, and its GGUF blocks (if any) are dequantized for it.
        self.row_invariant = row_invariant
        self.in_features = in_features
        self.out_sizes = tuple(out_sizes)
        self.out_features = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )
        self._kernel: LinearKernel | None = None
        self.backend = "dense"  # the kernel finalize() chose: "dense", "onednn" or "gguf"
        self.quantized: dict[int, QuantizedWeight] = {}  # shard → GGUF blocks (kept quantized)
        # --quantization q8_0 (worker/model_builder.round_linears_to_q8_0): dense weights given
        # to load_shard are rounded to Q8_0 blocks and kept so.
        self.round_to_q8_0 = False
        # LoRA adapters' side path (model/lora.py LinearLoRA), added to the kernel's output.
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    def load_shard(
        self, name: str, tensor: torch.Tensor, shard: int = 0, is_bias: bool = False
    ) -> None:
        """Copy one HF tensor ([out_i, in] weight or [out_i] bias) into shard `shard`, or keep
        a quantized weight's GGUF blocks for the quantized kernel."""
        if self.round_to_q8_0 and not is_bias and holds_floats(tensor):
            tensor = q8_0_blocks(dense(tensor))
        if is_quantized(tensor):
            self._keep_quantized(name, tensor, shard, is_bias)
            return
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError(f"unexpected weight {name}: this layer has no bias")
        rows = self.shard_rows(shard)
        expected = (
            (self.out_sizes[shard],) if is_bias else (self.out_sizes[shard], self.in_features)
        )
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"weight {name}: expected shape {list(expected)}, got {list(tensor.shape)}"
            )
        with torch.no_grad():
            target[rows].copy_(tensor)
        self._kernel = None  # weights changed: re-pack in finalize()

    def _keep_quantized(
        self, name: str, weight: QuantizedWeight, shard: int, is_bias: bool
    ) -> None:
        expected = (self.out_sizes[shard], self.in_features)
        if is_bias or (weight.rows, weight.cols) != expected:
            raise ValueError(
                f"weight {name}: expected shape {list(expected)}, got {[weight.rows, weight.cols]}"
            )
        self.quantized[shard] = weight
        self._kernel = None

    def finalize(
        self,
        backend: str = "auto",
        cpu: CpuFeatures | None = None,
        quant_kernels: QuantKernels | None = None,
        dequant_buffer: DequantBuffer | None = None,
    ) -> None:
        """Choose the kernel. Quantized shards run on their blocks when every shard is
        quantized (and the dense weight is released); a mix is dequantized into the weight."""
        if self.backend == "gguf" and self._kernel is not None and not self.quantized:
            return  # already on its blocks (the loaded shards were handed to the kernel)
        rows_here = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        if self.row_invariant and rows_here:
            backend = "rows"
        elif self.quantized and len(self.quantized) == len(self.out_sizes):
            shards = [self.quantized[i] for i in range(len(self.out_sizes))]
            self.backend = "gguf"
            self._kernel = QuantizedLinearKernel(quant_kernels, shards, self.bias, dequant_buffer)
            self.weight = nn.Parameter(
                self.weight.new_empty(0, self.in_features), requires_grad=False
            )
            # The kernel holds them now (merged, maybe repacked): no second copy.
            self.quantized = {}
            return
        for shard, weight in self.quantized.items():
            with torch.no_grad():
                self.weight[self.shard_rows(shard)].copy_(
                    quant_kernels.dequant_rows(
                        weight.qtype, weight.data, weight.cols, torch.arange(weight.rows)
                    )
                )
        self.quantized = {}
        self.backend = choose_linear_backend(self.weight, backend, cpu)
        self._kernel = make_linear_kernel(self.weight, self.bias, self.backend)

    def use_weight(self, weight: torch.Tensor) -> None:
        """Hold `weight` (same shape; a view into a stacked tensor, say) as the dense weight;
        F.linear runs it until finalize() chooses a kernel again."""
        if weight.shape != self.weight.shape:
            raise ValueError(f"expected shape {list(self.weight.shape)}, got {list(weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self._kernel, self.backend = None, "dense"

    @property
    def kernel(self) -> LinearKernel | None:
        return self._kernel

    def quantized_weights(self) -> list:
        """The GGUF blocks this layer holds: as loaded before finalize(), as its kernel holds
        them after (KernelWeight, merged and maybe tiled)."""
        if isinstance(self._kernel, QuantizedLinearKernel):
            return list(self._kernel.shards)
        return list(self.quantized.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) if self._kernel is None else self._kernel(x)
        return y if self.lora is None else self.lora(x, y)


def q8_0_blocks(weight: torch.Tensor) -> KernelWeight:
    """A dense [rows, cols] weight (cols a multiple of 32) as GGUF Q8_0 rows, rounded as
    llama.cpp's quantize_row_q8_0_ref rounds them (model/kv_quant.py's q8_0 rows are exactly
    these blocks)."""
    if weight.dim() != 2:
        raise ValueError(f"Q8_0 blocks need a matrix, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    blocks = kv_quant.quantize(weight, torch.uint8)
    return KernelWeight(int(GGMLQuantizationType.Q8_0), blocks, cols, rows)
