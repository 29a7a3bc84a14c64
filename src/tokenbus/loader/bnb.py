"""bitsandbytes safetensors (L2): checkpoints transformers saved with `load_in_4bit` (NF4 or
FP4, double quantization or not: the "-bnb-4bit" releases) or `load_in_8bit` (LLM.int8), their
linears read as the fp32 values bitsandbytes' own dequantization gives.

4-bit: `<linear>.weight` is uint8 [n / 2, 1], two 4-bit codes a byte, the high nibble first,
over the matrix's n values in row-major order; `weight.quant_map` [16] each code's value, and
each run of `blocksize` values is scaled by its absmax: `weight.absmax` fp32, or under double
quantization uint8 codes of `weight.nested_quant_map` [256], scaled by `weight.nested_absmax`
(one per `nested_blocksize` absmaxes) plus the state's `nested_offset`. The state itself,
`weight.quant_state.bitsandbytes__nf4` (or `__fp4`), is JSON in uint8 bytes: shape,
blocksize, nested_blocksize, nested_offset. value = quant_map[code] * absmax[i // blocksize].

8-bit: `<linear>.weight` int8 [out, in] and `<linear>.SCB` [out], each row's absmax: value =
q * SCB * (1 / 127), in that order (bitsandbytes' int8_vectorwise_dequant); `weight_format`
is dropped. Kept quantized (`--quantization` auto on CPU), a row of 32k values becomes Q8_0
blocks of q with d = SCB / 127 rounded once to fp16. 4-bit codes have no GGUF block (NF4's and
FP4's tables are not a Q4's steps): they come as fp32, which auto rounds to Q8_0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

from tokenbus.loader.gguf_loader import QuantizedWeight

if TYPE_CHECKING:
    import torch

_STATE = "quant_state.bitsandbytes__"  # + nf4 / fp4
_INT8_STEP = 7.874015718698502e-3  # bitsandbytes' 1 / 127, as it multiplies
_BLOCK = 32  # Q8_0 values a block


@dataclass(frozen=True)
class BnbScheme:
    bits: int  # 4 or 8


def bnb_scheme(config: dict[str, Any], path: object) -> BnbScheme | None:
    """The bitsandbytes layout config.json's `quantization_config` names, None for another
    method; one that loads neither 4-bit nor 8-bit weights is a ValueError."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "bitsandbytes":
        return None
    if quantization.get("load_in_4bit", quantization.get("_load_in_4bit")):
        return BnbScheme(4)
    if quantization.get("load_in_8bit", quantization.get("_load_in_8bit")):
        return BnbScheme(8)
    raise ValueError(f"{path}: quantization_config (bitsandbytes) loads neither 4- nor 8-bit")


def bnb_dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: BnbScheme, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each quantized linear's `weight` and its parts as one `weight`: fp32, or (8-bit,
    keep_quantized) Q8_0 blocks; a linear waits for all of its parts (shards may split them).
    Float tensors (the modules left unquantized) pass. A part left without the rest is a
    ValueError naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # "<linear>.weight" -> its parts
    for name, tensor in weights:
        base, part = _part(name, tensor, scheme)
        if base is None:
            yield name, tensor
            continue
        if part == "weight_format":
            continue
        parts = pending.setdefault(base, {})
        parts[part] = tensor
        if _complete(parts, scheme):
            del pending[base]
            yield base, _matrix(parts, scheme, keep_quantized, base)
    for base, parts in pending.items():
        raise ValueError(
            f"weight {base}: bitsandbytes parts {sorted(parts)} without the rest of its linear"
        )


def _part(name: str, tensor: torch.Tensor, scheme: BnbScheme) -> tuple[str | None, str]:
    """(the linear's weight name, which part) for a part of a quantized linear, else None."""
    if name.endswith(".weight") and not tensor.dtype.is_floating_point:
        return name, "weight"  # the codes (uint8) or int8 values
    if scheme.bits == 8:
        for leaf in ("SCB", "weight_format"):
            if name.endswith("." + leaf):
                return name.removesuffix(leaf) + "weight", leaf
        return None, ""
    base, marker, part = name.partition(".weight.")
    if marker and part:
        return base + ".weight", part
    return None, ""


def _complete(parts: dict[str, torch.Tensor], scheme: BnbScheme) -> bool:
    if scheme.bits == 8:
        return {"weight", "SCB"} <= parts.keys()
    state = _state(parts)
    if state is None:
        return False
    needed = {"weight", "absmax", "quant_map"}
    if "nested_blocksize" in state:
        needed |= {"nested_absmax", "nested_quant_map"}
    return needed <= parts.keys()


def _state(parts: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    for part, tensor in parts.items():
        if part.startswith(_STATE):
            return json.loads(bytes(tensor.flatten().tolist()))
    return None


def _matrix(
    parts: dict[str, torch.Tensor], scheme: BnbScheme, keep_quantized: bool, name: str
) -> torch.Tensor | QuantizedWeight:
    import torch

    if scheme.bits == 8:
        q, scb = parts["weight"], parts["SCB"].to(torch.float32)
        if q.dtype != torch.int8 or scb.shape != (q.shape[0],):
            raise ValueError(
                f"weight {name}: bitsandbytes int8 {q.dtype} {list(q.shape)} with SCB "
                f"{list(scb.shape)}"
            )
        if keep_quantized and q.shape[1] % _BLOCK == 0:
            return _q8_0_rows(q, scb)
        return q.to(torch.float32) * scb.view(-1, 1) * _INT8_STEP
    state = _state(parts)
    shape, blocksize = tuple(state["shape"]), int(state["blocksize"])
    packed = parts["weight"].flatten()
    count = shape[0] * shape[1]
    if packed.dtype != torch.uint8 or packed.numel() * 2 < count:
        raise ValueError(f"weight {name}: bitsandbytes codes {packed.dtype} for shape {shape}")
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten()[:count].long()
    absmax = parts["absmax"]
    if "nested_blocksize" in state:  # absmax codes, scaled per nested block, plus the offset
        nested = parts["nested_absmax"].to(torch.float32)
        spread = nested.repeat_interleave(int(state["nested_blocksize"]))[: absmax.numel()]
        table = parts["nested_quant_map"].to(torch.float32)
        absmax = table[absmax.long()] * spread + float(state["nested_offset"])
    absmax = absmax.to(torch.float32)
    if absmax.numel() != -(-count // blocksize):
        raise ValueError(
            f"weight {name}: bitsandbytes absmax [{absmax.numel()}] for {count} values in "
            f"blocks of {blocksize}"
        )
    values = parts["quant_map"].to(torch.float32)[codes]
    return (values * absmax.repeat_interleave(blocksize)[:count]).view(shape)


def _q8_0_rows(q: torch.Tensor, scb: torch.Tensor) -> QuantizedWeight:
    """int8 rows as Q8_0 blocks: each block d = SCB / 127 (fp16), its 32 values as they are."""
    import torch

    rows, cols = q.shape
    d = (scb * _INT8_STEP).to(torch.float16).view(rows, 1, 1).expand(rows, cols // _BLOCK, 1)
    head = d.contiguous().view(torch.uint8)  # [rows, blocks, 2]
    values = q.view(torch.uint8).view(rows, cols // _BLOCK, _BLOCK)
    data = torch.cat((head, values), dim=-1).reshape(rows, -1).contiguous()
    return QuantizedWeight(int(GGMLQuantizationType.Q8_0), data, cols)
