"""The `quantization_config`s a safetensors checkpoint may carry here (L2): gpt-oss's MXFP4
experts (loader/mxfp4.py), FP8 linears (loader/fp8.py), integer ones (GPTQ, AWQ and
compressed-tensors': loader/int_weights.py), bitsandbytes' 4- and 8-bit ones (loader/bnb.py).
Any other is refused by name: its GGUF is the file to load."""

from __future__ import annotations

from typing import Any

from tokenbus.loader.bnb import bnb_scheme
from tokenbus.loader.fp8 import fp8_scheme
from tokenbus.loader.int_weights import packed_scheme


def is_mxfp4(config: dict[str, Any]) -> bool:
    """Whether config.json says its experts are OpenAI's MXFP4 blocks (loader/mxfp4.py)."""
    quantization = config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def prequantized(config: dict[str, Any], path: object) -> bool:
    """Whether config.json names FP8, integer or bitsandbytes linears (a layout of theirs that
    is not read is a ValueError naming the field)."""
    _check_compressed_tensors(config.get("quantization_config"), path)
    readers = (fp8_scheme, packed_scheme, bnb_scheme)
    return any(reader(config, path) is not None for reader in readers)


def _check_compressed_tensors(quantization: Any, path: object) -> None:
    """compressed-tensors' sparse layouts (2:4 bitmasks) and weight transforms (rotations) are
    not read: refused by name rather than loaded wrong."""
    if (
        not isinstance(quantization, dict)
        or quantization.get("quant_method") != "compressed-tensors"
    ):
        return
    sparsity = quantization.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(
            f"{path}: quantization_config sparsity_config format {sparsity['format']!r} "
            "(compressed-tensors) is not supported: dense checkpoints are read"
        )
    if quantization.get("transform_config"):
        raise ValueError(
            f"{path}: quantization_config transform_config (compressed-tensors) is not "
            "supported: checkpoints without weight transforms are read"
        )


def check_quantization(config: dict[str, Any], architecture: str, path: object) -> None:
    """A ValueError naming the method of a quantization_config that is not read."""
    quantization = config.get("quantization_config")
    if not quantization:
        return
    if (is_mxfp4(config) and architecture == "gpt_oss") or prequantized(config, path):
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    raise ValueError(
        f"{path}: quantization_config (quant_method {method!r}) is not supported: FP8, GPTQ, "
        "AWQ, compressed-tensors and bitsandbytes checkpoints and gpt-oss's MXFP4 experts are "
        "read; load the model's GGUF for other quantized weights"
    )
