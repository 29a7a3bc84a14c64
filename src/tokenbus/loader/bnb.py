"""bitsandbytes safetensors (L2): checkpoints transformers saved with `load_in_4bit` (NF4 or
FP4, double quantization or not: the "-bnb-4bit" releases) or `load_in_8bit` (LLM.int8), their
linears read as the fp32 values bitsandbytes' own dequantization gives.

4-bit: `<linear>.weight` is uint8 [n / 2, 1], two 4-bit codes a byte, the high nibble first,
over the matrix's n values in row-major order; `weight.quant_map` [16] each code's value, and
each run of `blocksize` values is scaled by its absmax: `weight.absmax` fp32, or under double
quantization uint8 codes of `weight.nested_quant_map` [256], scaled by `weight.nested_absmax`
(one per `nested_blocksize` absmaxes) plus the state's `nested_offset`. The state itself,
`weight.quant_state.bitsandbytes__nf4` (or `__fp4`), is JSON in uint8 bytes: shape,
blocksize, nested_blocksize, nested_offset, dtype. value = quant_map[code] * absmax[i //
blocksize] in fp32, then cast to the state's dtype (a bf16 model's: bf16) as bitsandbytes
casts it. A `bnb_4bit_quant_storage` other than uint8 stores the codes' bytes as that dtype.

8-bit: `<linear>.weight` int8 [out, in] and `<linear>.SCB` [out], each row's absmax: value =
q * SCB * (1 / 127), in that order (bitsandbytes' int8_vectorwise_dequant); `weight_format`
0 (row-major) is dropped, another (an older save's tiled layout) refused. Kept quantized
(`--quantization` auto on CPU), a row of 32k values becomes Q8_0 blocks of q with d = SCB / 127
rounded once to fp16. 4-bit codes have no GGUF block (NF4's and FP4's tables are not a Q4's
steps): they come as fp32, which auto rounds to Q8_0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenbus.loader.gguf_loader import QuantizedWeight, q8_0_weight

if TYPE_CHECKING:
    import torch

_STATE = "quant_state.bitsandbytes__"  # + nf4 / fp4
_LEAVES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")  # under `<linear>.weight.`
_INT8_STEP = 7.874015718698502e-3  # bitsandbytes' 1 / 127, as it multiplies
_ROUNDED = ("bfloat16", "float16")  # state dtypes bitsandbytes casts its values to


@dataclass(frozen=True)
class BnbScheme:
    bits: int  # 4 or 8
    storage: str = "uint8"  # the dtype 4-bit codes' bytes are stored as (bnb_4bit_quant_storage)


def bnb_scheme(config: dict[str, Any], path: object) -> BnbScheme | None:
    """The bitsandbytes layout config.json's `quantization_config` names, None for another
    method; one that loads neither 4-bit nor 8-bit weights is a ValueError."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "bitsandbytes":
        return None
    if quantization.get("load_in_4bit", quantization.get("_load_in_4bit")):
        storage = str(quantization.get("bnb_4bit_quant_storage") or "uint8")
        return BnbScheme(4, storage.removeprefix("torch."))
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
    pending: dict[str, dict[str, Any]] = {}  # "<linear>.weight" -> its parts (the state parsed)
    for name, tensor in weights:
        base, part = _part(name, tensor, scheme)
        if base is None:
            yield name, tensor
            continue
        if part == "weight_format":  # 0: row-major; others are tiled layouts of older saves
            if int(tensor.item()) != 0:
                raise ValueError(f"weight {name}: bitsandbytes weight_format {int(tensor.item())}")
            continue
        parts = pending.setdefault(base, {})
        parts[part] = json.loads(bytes(tensor.flatten().tolist())) if part == "state" else tensor
        if _complete(parts, scheme):
            del pending[base]
            yield base, _matrix(parts, scheme, keep_quantized, base)
    for base, parts in pending.items():
        raise ValueError(
            f"weight {base}: bitsandbytes parts {sorted(parts)} without the rest of its linear"
        )


def _part(name: str, tensor: torch.Tensor, scheme: BnbScheme) -> tuple[str | None, str]:
    """(the linear's weight name, which part) for a part of a quantized linear, else None."""
    if name.endswith(".weight"):
        # 4-bit codes: bytes, stored as the config's bnb_4bit_quant_storage dtype ([n / 2 /
        # its size, 1]); 8-bit: int8 values. A float weight of another shape: unquantized
        storage = str(tensor.dtype).removeprefix("torch.") == scheme.storage
        codes = scheme.bits == 4 and storage and tensor.dim() == 2 and tensor.shape[1] == 1
        if codes or not tensor.dtype.is_floating_point:
            return name, "weight"
        return None, ""
    if scheme.bits == 8:
        for leaf in ("SCB", "weight_format"):
            if name.endswith("." + leaf):
                return name.removesuffix(leaf) + "weight", leaf
        return None, ""
    base, _, leaf = name.rpartition(".weight.")
    if leaf in _LEAVES:
        return base + ".weight", leaf
    if leaf.startswith(_STATE):
        return base + ".weight", "state"
    return None, ""


def _complete(parts: dict[str, Any], scheme: BnbScheme) -> bool:
    if scheme.bits == 8:
        return {"weight", "SCB"} <= parts.keys()
    if "state" not in parts:
        return False
    needed = {"weight", "absmax", "quant_map"}
    if "nested_blocksize" in parts["state"]:
        needed |= {"nested_absmax", "nested_quant_map"}
    return needed <= parts.keys()


def _matrix(
    parts: dict[str, Any], scheme: BnbScheme, keep_quantized: bool, name: str
) -> torch.Tensor | QuantizedWeight:
    import torch

    if scheme.bits == 8:
        q, scb = parts["weight"], parts["SCB"].to(torch.float32)
        if q.dtype != torch.int8 or scb.shape != (q.shape[0],):
            raise ValueError(
                f"weight {name}: bitsandbytes int8 {q.dtype} {list(q.shape)} with SCB "
                f"{list(scb.shape)}"
            )
        if keep_quantized and q.shape[1] % 32 == 0:  # d = SCB / 127 for each 32-value block
            d = (scb * _INT8_STEP).view(-1, 1).expand(q.shape[0], q.shape[1] // 32)
            return q8_0_weight(d, q)
        return q.to(torch.float32) * scb.view(-1, 1) * _INT8_STEP
    state = parts["state"]
    shape, blocksize = tuple(state["shape"]), int(state["blocksize"])
    packed = parts["weight"].contiguous().view(torch.uint8).flatten()
    count = shape[0] * shape[1]
    if packed.numel() * 2 < count:
        raise ValueError(f"weight {name}: bitsandbytes codes [{packed.numel()}] for {shape}")
    # two codes a byte, the high nibble first
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten()[:count].int()
    values = parts["quant_map"].to(torch.float32)[codes]
    absmax = _absmax(parts, state, name)
    if absmax.numel() != -(-count // blocksize):
        raise ValueError(
            f"weight {name}: bitsandbytes absmax [{absmax.numel()}] for {count} values in "
            f"blocks of {blocksize}"
        )
    if count % blocksize == 0:
        values = values.view(-1, blocksize).mul_(absmax.unsqueeze(1))
    else:
        values = values.mul_(absmax.repeat_interleave(blocksize)[:count])
    if state.get("dtype") in _ROUNDED:  # bitsandbytes casts its values to the state's dtype
        values = values.to(getattr(torch, state["dtype"])).to(torch.float32)
    return values.view(shape)


def _absmax(parts: dict[str, Any], state: dict[str, Any], name: str) -> torch.Tensor:
    """Each block's absmax in fp32: as stored, or (double quantization) its uint8 code's value
    in nested_quant_map, scaled per nested_blocksize absmaxes, plus the state's offset."""
    import torch

    absmax = parts["absmax"]
    nested = "nested_blocksize" in state
    if (absmax.dtype == torch.uint8) != nested:
        raise ValueError(
            f"weight {name}: bitsandbytes absmax {absmax.dtype} "
            f"{'with' if nested else 'without'} double quantization"
        )
    if not nested:
        return absmax.to(torch.float32)
    scales = parts["nested_absmax"].to(torch.float32)
    spread = scales.repeat_interleave(int(state["nested_blocksize"]))[: absmax.numel()]
    table = parts["nested_quant_map"].to(torch.float32)
    return table[absmax.int()] * spread + float(state["nested_offset"])
