"""OpenAI's MXFP4 safetensors (gpt-oss's released checkpoints; L2): the experts of each layer as
`<name>_blocks` (uint8 [E, rows, G, 16], two 4-bit values a byte) and `<name>_scales` (uint8
[E, rows, G], an E8M0 exponent per 32 values), turned into the per-expert tensors the MoE block
loads: GGUF MXFP4 blocks the tile kernels run (kept quantized), or fp32.

The two layouts hold the same codes (E2M1: a sign bit over 0, 0.5, 1, 1.5, 2, 3, 4, 6) and the
same exponent, so the conversion only moves bits, exactly:
- OpenAI's byte j of a block holds value 2j in its low nibble and 2j + 1 in its high one, and the
  scale is 2^(e - 127) (transformers' convert_moe_packed_tensors);
- ggml's MXFP4 block is the exponent byte, then 16 bytes whose byte j holds value j low and value
  j + 16 high, its table the codes doubled and its scale 2^(e - 128) (llama.cpp's converter does
  this same repacking: GptOssModel.repack_mxfp4).

Rows are output features: gate_up's [2I] interleave gate (even rows) and up (odd rows), as the
dense checkpoint's columns do (model/gpt_oss.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType

from tokenbus.loader.gguf_loader import QuantizedWeight

if TYPE_CHECKING:
    import torch

_SUFFIXES = ("_blocks", "_scales")
# OpenAI's E2M1 codes (transformers' FP4_VALUES)
_FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's blocks [..., G, 16] and scales [..., G] -> ggml MXFP4 rows [..., G * 17]."""
    import torch

    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's blocks [..., G, 16] and scales [..., G] -> fp32 values [..., G * 32]."""
    import torch

    table = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1)).flatten(-2)


def gpt_oss_experts(
    weights: Iterable[tuple[str, torch.Tensor]], keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """gpt-oss's `experts.{gate_up,down}_proj_{blocks,scales}` as per-expert
    `experts.E.{gate,up,down}_proj.weight`: MXFP4 blocks (keep_quantized) or fp32 [rows, cols];
    every other tensor as it comes. A layer's blocks wait for their scales (either may come
    first)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, suffix = name[:-7], name[-7:]
        if suffix not in _SUFFIXES or ".mlp.experts." not in name:
            yield name, tensor
            continue
        halves = pending.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) == 2:
            del pending[base]
            yield from _split(base, halves["_blocks"], halves["_scales"], keep_quantized)
    if pending:
        raise ValueError(f"weight {next(iter(pending))}: MXFP4 blocks without their scales")


def _split(
    base: str, blocks: torch.Tensor, scales: torch.Tensor, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    import torch

    scope, _, kind = base.rpartition(".")  # model.layers.N.mlp.experts, gate_up_proj | down_proj
    uint8 = blocks.dtype == scales.dtype == torch.uint8
    if kind not in ("gate_up_proj", "down_proj") or not uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"weight {base}_blocks: unexpected MXFP4 tensors {blocks.dtype} "
            f"{list(blocks.shape)}, scales {scales.dtype} {list(scales.shape)}"
        )
    cols = blocks.shape[-2] * 32
    parts = (
        (("gate_proj", 0, 2), ("up_proj", 1, 2))
        if kind == "gate_up_proj"
        else (("down_proj", 0, 1),)
    )
    convert = ggml_blocks if keep_quantized else dequantize
    for e in range(blocks.shape[0]):  # an expert at a time: a whole layer's fp32 runs to GBs
        rows = convert(blocks[e], scales[e])  # [out, cols / 32 * 17] blocks or [out, cols] fp32
        for name, first, step in parts:
            matrix = rows[first::step].contiguous()
            if keep_quantized:
                matrix = QuantizedWeight(int(GGMLQuantizationType.MXFP4), matrix, cols)
            yield f"{scope}.{e}.{name}.weight", matrix
