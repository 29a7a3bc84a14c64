"""Build a model on its device and dtype and fill it from its weight file(s) (L3).

Here, not in `loader`, because it joins two L2 siblings: `model` (the classes) and `loader`
(shapes and weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenbus.config import BLOCK_QUANTIZATIONS, Q8_0_BLOCK_VALUES
from tokenbus.loader import ModelSource, iter_weights
from tokenbus.model.kernel_plan import KernelRequest, apply_kernels
from tokenbus.model.layers import Linear
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.registry import get_model_class
from tokenbus.model_arch import ModelArch


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
    max_model_len: int | None = None,
) -> nn.Module:
    """The whole model, or this rank's shard of it under tensor parallelism; GGUF weights kept
    in their blocks when `quantization` is gguf (resolved: engine/setup.resolve_quantization;
    any other value dequantizes), their decode calls on int16, int8, fp32 or (AVX512-BF16) bf16
    activations (`quant_activations`: ModelConfig). Decode steps run their layers in C where
    they can, unless `enforce_eager` (op by op). `batch_invariant`: every kernel's result for a
    token independent of the rest of its step (ModelConfig.batch_invariant). `max_model_len`
    (the engine's context; None: the model's): the model is built for positions below it (its
    rotary table; LongRoPE picks its factor set from it, model/layers/rotary.py)."""
    model_class = get_model_class(arch.architecture)
    if max_model_len is not None:
        arch = dataclasses.replace(arch, max_position_embeddings=max_model_len)
    keep_quantized = quantization in BLOCK_QUANTIZATIONS
    if quant_activations in ("int8", "int16", "bf16", "q8_k") and not keep_quantized:
        raise ValueError(
            f"quant_activations {quant_activations!r} needs GGUF weights kept quantized "
            f"(--quantization gguf or q8_0)"
        )
    with torch.device(device), _default_dtype(dtype):
        model = model_class(arch, tp)  # parameters allocated uninitialised, in place (never
        # written, so never resident, for weights that stay quantized)
    if quantization == "q8_0":
        round_linears_to_q8_0(model)
    if load_format == "dummy":
        fill_dummy_weights(model, seed + tp.rank)
    else:
        model.load_weights(iter_weights(src, arch, keep_quantized))  # casts to dtype on copy
    request = KernelRequest(
        attention_backend,
        decode_layers=not enforce_eager,
        batch_invariant=batch_invariant,
        quant_activations=quant_activations if keep_quantized else None,
    )
    apply_kernels(model, request)  # every kernel chosen here, once (model/kernel_plan.py)
    return model.eval()


def round_linears_to_q8_0(model: nn.Module) -> None:
    """--quantization q8_0: every linear whose rows split into Q8_0's 32-value blocks takes its
    dense weights as Q8_0 blocks (layers/linear.Linear.round_to_q8_0), so it runs on the
    quantized kernels like a Q8_0 GGUF's. MoE routers stay dense (row-invariant: their logits
    choose experts), as a GGUF's do."""
    for module in model.modules():
        if isinstance(module, Linear) and not module.row_invariant:
            module.round_to_q8_0 = module.in_features % Q8_0_BLOCK_VALUES == 0


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


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
