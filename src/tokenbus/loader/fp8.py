"""FP8 safetensors (L2): checkpoints released with 8-bit float weights, each matrix beside the
scales that multiply it back, read as the fp32 matrices they stand for.

Three `quantization_config`s name them, all with the same arithmetic, W = q * s:
- `fp8` (transformers' FineGrainedFP8: Qwen3's and Qwen3-MoE's -FP8 releases, DeepSeek-V3,
  MiniMax-M2): `<linear>.weight_scale_inv` holds one scale per block of
  `weight_block_size` [rows, cols] (128 x 128 in those releases, and where a config names
  none, as transformers reads it), the grid rounded up where a side is not a multiple; a null
  block size: one scale for the matrix, or one a row, as the scale's shape says;
- `compressed-tensors` in its `float-quantized` format (llm-compressor's FP8 and FP8-dynamic
  releases): `<linear>.weight_scale` per matrix (`strategy` tensor), per output row
  (channel) or per block (`block_structure`);
- `fbgemm_fp8` (Meta's Llama 3.1 FP8): `<linear>.weight_scale` per output row.

Every tensor whose dtype is an 8-bit float takes the scale tensor of its own name
(`<name>_scale_inv` or `<name>_scale`: a linear's `weight`, `weight_scale_inv`); the rest (norms,
embeddings, routers, the layers a config leaves unquantized) pass as they come. The
activation and KV scales a checkpoint keeps for fp8 GEMMs and an fp8 cache (`input_scale`,
`k_scale`, ...) are dropped: activations here stay in the engine's precision, and the KV cache
is its own (`--kv-cache-dtype`). On CPU the engine then rounds the fp32 matrices to Q8_0
blocks (engine/setup.resolve_quantization): 8 bits a weight, as the checkpoint has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_SCALE_SUFFIXES = ("_scale_inv", "_scale")  # `<values>_scale_inv` / `<values>_scale`
# scales of the fp8 GEMM's activations and of an fp8 KV cache (llm-compressor's older files
# name a KV scale `output_scale`): nothing here reads them
_DROPPED = (
    "input_scale",
    "input_scale_ub",
    "activation_scale",
    "output_scale",
    "k_scale",
    "v_scale",
    "kv_scale",
)
_STRATEGIES = ("tensor", "channel", "block")
_DEFAULT_BLOCK = [128, 128]  # FineGrainedFP8Config's weight_block_size, where a config names none


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 matrices are scaled: `block` the [rows, cols] one scale covers
    where the config names it (None, or a scale of another grid: one scale for the matrix or
    one a row, read from the scale's own shape)."""

    block: tuple[int, int] | None = None


def fp8_scheme(config: dict[str, Any], path: object) -> Fp8Scheme | None:
    """The FP8 scheme config.json's `quantization_config` names (quant_method fp8,
    fbgemm_fp8, or compressed-tensors' float-quantized format), None for any other; an FP8
    layout this reader does not know is a ValueError naming the field."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return None
    method = quantization.get("quant_method")
    if method == "fp8":  # an explicit null: no blocks
        return Fp8Scheme(_block(quantization.get("weight_block_size", _DEFAULT_BLOCK), path))
    if method == "fbgemm_fp8":
        return Fp8Scheme()
    if method == "compressed-tensors":
        return _compressed_tensors(quantization, path)
    return None


def _compressed_tensors(quantization: dict[str, Any], path: object) -> Fp8Scheme | None:
    if quantization.get("format") != "float-quantized":
        return None  # its integer formats: loader/int_weights.py (which refuses the rest)
    blocks = set()
    for name, group in (quantization.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in _STRATEGIES:
            raise ValueError(
                f"{path}: quantization_config config_groups.{name}.weights (type, num_bits, "
                f"strategy) {kind} is not supported: FP8 weights by {'/'.join(_STRATEGIES)}"
            )
        if kind[2] == "block":
            blocks.add(_block(weights.get("block_structure"), path))
    if len(blocks) > 1:
        raise ValueError(f"{path}: quantization_config config_groups name several block sizes")
    return Fp8Scheme(blocks.pop() if blocks else None)


def _block(value: Any, path: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(int(v) > 0 for v in value)):
        raise ValueError(f"{path}: quantization_config block size {value!r} is not [rows, cols]")
    return int(value[0]), int(value[1])


def dequantized_fp8(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each FP8 tensor as fp32, multiplied by its scales (`<values>_scale_inv` or
    `<values>_scale`: a linear's `weight` takes `weight_scale_inv`); a tensor waits for its
    scales (either may come first: shards split them). Other tensors pass; activation and KV
    scales are dropped. FP8 values without their scales, or a weight's scale without its
    values, are a ValueError naming them."""
    values: dict[str, torch.Tensor] = {}  # name -> fp8 values waiting for their scales
    scales: dict[str, tuple[str, torch.Tensor]] = {}  # values' name -> (scale's name, tensor)
    for name, tensor in weights:
        if name.rpartition(".")[2] in _DROPPED:
            continue
        if _is_fp8(tensor):
            if name in scales:
                scale_name, scale = scales.pop(name)
                yield name, dequantize(tensor, scale, scheme, scale_name)
            else:
                values[name] = tensor
            continue
        base = _scaled(name)
        if base is None:
            yield name, tensor
        elif base in values:
            yield base, dequantize(values.pop(base), tensor, scheme, name)
        else:
            scales[base] = (name, tensor)
    if values:
        raise ValueError(f"weight {next(iter(values))}: FP8 values without their scale")
    for base, (name, tensor) in scales.items():
        if base.endswith(".weight"):
            raise ValueError(f"weight {name}: a scale without FP8 values")
        yield name, tensor  # a parameter of the model's own whose name ends in _scale


def _scaled(name: str) -> str | None:
    """The name of the values a scale's name scales, or None when it names no scale."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def _is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point and tensor.element_size() == 1


def dequantize(
    values: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, name: str
) -> torch.Tensor:
    """FP8 values [..., rows, cols] times their scales -> fp32: one scale (a tensor's), one a
    row ([rows, 1]) or one a block ([ceil(rows / br), ceil(cols / bc)], the last block of a
    side cut short). Leading dims (experts stacked in one tensor) carry their own scales."""
    import torch

    rows, cols = values.shape[-2:]
    scale = scale.to(torch.float32)
    out = values.to(torch.float32)
    if scale.numel() == 1:
        return out.mul_(scale.reshape(()))
    grid = tuple(scale.shape[-2:]) if scale.dim() >= 2 else (scale.shape[0], 1)
    if scheme.block is not None and grid != (rows, 1):  # a row's scale beside blocks: per row
        block_rows, block_cols = scheme.block
    elif rows % grid[0] == 0 and cols % grid[1] == 0:  # per row, or blocks the grid divides
        block_rows, block_cols = rows // grid[0], cols // grid[1]
    else:
        block_rows = block_cols = 0
    want = (math.ceil(rows / block_rows), math.ceil(cols / block_cols)) if block_rows else None
    if grid != want or scale.numel() * rows * cols != math.prod(grid) * values.numel():
        raise ValueError(
            f"weight {name}: scales {list(scale.shape)} do not cover FP8 values "
            f"{list(values.shape)}"
            + (f" in blocks of {list(scheme.block)}" if scheme.block else "")
        )
    scale = scale.reshape(*values.shape[:-2], *grid)
    # each scale spread over its block, the grid's last row and column cut to the matrix
    spread = scale.repeat_interleave(block_rows, -2)[..., :rows, :]
    return out.mul_(spread.repeat_interleave(block_cols, -1)[..., :cols])
