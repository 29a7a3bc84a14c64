"""Build a model on its device and dtype and fill it from its weight file(s) (L3).

Here, not in `loader`, because it joins two L2 siblings: `model` (the classes) and `loader`
(shapes and weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenbus.config import ModelArch
from tokenbus.loader import ModelSource, iter_weights
from tokenbus.model.layers import Linear
from tokenbus.model.layers.quantized import (
    BF16_AUTO_MIN_ROWS,
    GEMM_FROM_ROWS,
    INT_TILES_ANY_ROWS_ISAS,
    TileModes,
)
from tokenbus.model.native import QuantKernels
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.registry import get_model_class
from tokenbus.utils.cpu import CpuFeatures


def load_model(
    src: ModelSource,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str = "auto",
    tp: TensorParallel = SINGLE,
    quantization: str = "none",
    quant_activations: str = "auto",
    enforce_eager: bool = False,
    load_format: str = "auto",
    seed: int = 0,
    batch_invariant: bool = False,
) -> nn.Module:
    """The whole model, or this rank's shard of it under tensor parallelism; GGUF weights kept
    in their blocks when `quantization` is gguf (resolved: engine/setup.resolve_quantization;
    any other value dequantizes), their decode calls on int16, int8, fp32 or (AVX512-BF16) bf16
    activations (`quant_activations`: ModelConfig). Decode steps run their layers in C where
    they can, unless `enforce_eager` (op by op). `batch_invariant`: every kernel's result for a
    token independent of the rest of its step (ModelConfig.batch_invariant)."""
    model_class = get_model_class(arch.architecture)
    keep_quantized = quantization == "gguf"
    if quant_activations in ("int8", "int16", "bf16") and not keep_quantized:
        raise ValueError(
            f"quant_activations {quant_activations!r} needs GGUF weights kept quantized "
            f"(--quantization gguf)"
        )
    with torch.device(device), _default_dtype(dtype):
        model = model_class(arch, tp)  # parameters allocated uninitialised, in place (never
        # written, so never resident, for weights that stay quantized)
    if load_format == "dummy":
        fill_dummy_weights(model, seed + tp.rank)
        model.finalize()
    else:
        model.load_weights(iter_weights(src, arch, keep_quantized))  # casts to dtype on copy
    if batch_invariant:
        use_row_invariant_linears(model)  # before the C decode layers read the kernels
    model.set_attention_backend(
        attention_backend, decode_layers=not enforce_eager, row_invariant=batch_invariant
    )
    if keep_quantized:
        model.set_quant_activations(
            quant_activation_modes(quant_activations, model.quant_kernels, batch_invariant)
        )
    return model.eval()


def use_row_invariant_linears(model: nn.Module) -> None:
    """Dense linears on dense_rows.c, whose rows never depend on each other (oneDNN's GEMM sums
    a row differently at different row counts); those on GGUF blocks keep their kernels, which
    TileModes.row_invariant keeps row-local."""
    for module in model.modules():
        if isinstance(module, Linear) and module.backend != "gguf":
            module.finalize("rows")


def fill_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """--load-format dummy: every parameter drawn where it lives (device and dtype), seeded.

    Scaled like an initialisation (transformers' initializer_range: N(0, 0.02) for matrices,
    norms at 1, biases at 0), so activations stay finite through any depth."""
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if param.numel() == 0:
                continue
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
                continue
            gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + index)
            param.normal_(0.0, std, generator=gen)


def quant_activation_modes(
    requested: str, kernels: QuantKernels | None, row_invariant: bool = False
) -> TileModes:
    """set_quant_activations' TileModes for a ModelConfig.quant_activations: auto is int16, and
    bf16 from BF16_AUTO_MIN_ROWS[engine] rows where the CPU has a bf16 engine (AMX: prefill chunks
    and decode batches of 16+; AVX512-BF16: prefill chunks), else int16 at any size on
    INT_TILES_ANY_ROWS_ISAS (AVX2, AVX-512); bf16 is bf16 for every call and needs an engine; an
    explicit int8 or int16 takes its tiles at any size on those ISAs too (there they beat
    dequantizing for the GEMM). Calls past the decode-sized ones dequantize for the fp32 GEMM
    otherwise. `row_invariant` (--batch-invariant): one mode at every size (auto: int16), on the
    block kernels only (TileModes.row_invariant)."""
    engine = kernels.bf16_engine if kernels is not None else ""
    any_rows = not engine and kernels is not None and kernels.isa in INT_TILES_ANY_ROWS_ISAS
    if requested == "bf16":
        if not engine:
            raise ValueError(
                "quant_activations 'bf16' needs AVX512-BF16 (avx512_bf16; AMX tiles where the "
                f"kernel grants them); this CPU: {CpuFeatures.detect().describe()}"
            )
        return TileModes("bf16", 1, 0, row_invariant)
    if row_invariant:
        return TileModes("int16" if requested == "auto" else requested, 0, 0, True)
    if requested == "auto":
        return TileModes(
            "int16", BF16_AUTO_MIN_ROWS.get(engine, 0), 0 if any_rows else GEMM_FROM_ROWS
        )
    return TileModes(
        requested, 0, 0 if any_rows and requested in ("int8", "int16") else GEMM_FROM_ROWS
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
