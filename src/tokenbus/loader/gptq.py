"""GPTQ and AWQ safetensors (L2): integer weights packed eight (4-bit) or four (8-bit) to an
int32, with a scale and a zero point per group of `group_size` input columns, read as the
GGUF blocks that hold the same values exactly where they can, else as fp32.

Both formats store, for a linear of [out, in], value = (q - z) * s, s and z those of the input
column's group. Their packing differs (each tensor's low bits first):
- GPTQ (AutoGPTQ, GPTQModel; Qwen's -GPTQ-Int4/Int8 releases): `qweight` int32 [in / pack,
  out] packs input rows; `qzeros` int32 [groups, out / pack] packs output columns and, in the
  original `checkpoint_format` "gptq", holds z - 1 (`gptq_v2`: z); `scales` [groups, out];
  `g_idx` [in] the group of each input column (`desc_act`: reordered, else i // group_size);
- AWQ, its `gemm` version (AutoAWQ; Qwen's -AWQ releases): `qweight` int32 [in, out / 8] and
  `qzeros` int32 [groups, out / 8] both pack output columns, nibble k of word c holding column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[k]; `scales` [groups, out].

Kept quantized (`--quantization` auto on CPU, as for FP8 checkpoints), a 4-bit matrix whose
groups hold whole 32-column blocks becomes GGUF Q4_1 (each block: d = s, m = -z * s, its 4-bit
q as they are): exact where m is exact in fp16 (a symmetric GPTQ's z = 8: m = -8s), else m
rounded once to fp16. An 8-bit symmetric one (z = 128) becomes Q8_0 (d = s, q - 128), exactly.
Any other (act-order groups, 8-bit asymmetric) comes as fp32 and is rounded to Q8_0 with the
dense weights. The embedding and LM head, unquantized in these files, load as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

from tokenbus.loader.gguf_loader import QuantizedWeight

if TYPE_CHECKING:
    import torch

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column nibble k of a word holds, within its 8
_BLOCK = 32  # GGUF Q4_1 / Q8_0 values a block


@dataclass(frozen=True)
class PackedScheme:
    """A GPTQ or AWQ checkpoint's layout. `group_size` -1: one group a row. `zero_offset`:
    what GPTQ's original format subtracted from each stored zero (1), else 0."""

    method: str
    bits: int
    group_size: int
    act_order: bool = False
    zero_offset: int = 0


def packed_scheme(config: dict[str, Any], path: object) -> PackedScheme | None:
    """The GPTQ or AWQ layout config.json's `quantization_config` names, None for other
    methods; a layout this reader does not know (3-bit, AWQ's gemv kernels' packing, Marlin's)
    is a ValueError naming the field."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return None
    method = quantization.get("quant_method")
    if method not in ("gptq", "awq"):
        return None
    bits = quantization.get("bits", quantization.get("w_bit"))
    group_size = quantization.get("group_size", quantization.get("q_group_size", 128))
    allowed = (4, 8) if method == "gptq" else (4,)
    if bits not in allowed:
        raise ValueError(f"{path}: quantization_config bits {bits!r} ({method}): {allowed} read")
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{path}: quantization_config group_size {group_size!r}")
    if method == "awq":
        version = str(quantization.get("version", "gemm")).lower()
        if version != "gemm" or quantization.get("zero_point") is False:
            raise ValueError(
                f"{path}: quantization_config version {version!r} (awq) is not supported: "
                "AWQ's gemm packing with zero points is read"
            )
        return PackedScheme(method, bits, group_size)
    fmt = quantization.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2") or quantization.get("is_marlin_format"):
        raise ValueError(
            f"{path}: quantization_config checkpoint_format {fmt!r} (gptq) is not supported: "
            "'gptq' and 'gptq_v2' are read"
        )
    return PackedScheme(
        method, bits, group_size, bool(quantization.get("desc_act")), int(fmt == "gptq")
    )


def unpacked(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: PackedScheme, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each packed linear's parts (`<linear>.qweight`, `.qzeros`, `.scales`, GPTQ's `.g_idx`)
    as `<linear>.weight`: GGUF blocks (keep_quantized, where exact as the module says) or fp32
    [out, in]; a linear waits for all of its parts (shards may split them). Other tensors
    pass. A part left without the rest is a ValueError naming it."""
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if scheme.act_order else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _PARTS:
            yield name, tensor
            continue
        if leaf == "g_idx" and not scheme.act_order:  # column // group_size: nothing to read
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            del pending[prefix]
            yield f"{prefix}.weight", _linear(parts, scheme, keep_quantized, prefix)
    for prefix, parts in pending.items():
        if needed - parts.keys():
            missing = ", ".join(sorted(needed - parts.keys()))
            raise ValueError(f"weight {prefix}: {scheme.method} parts without {missing}")


def _linear(
    parts: dict[str, torch.Tensor], scheme: PackedScheme, keep_quantized: bool, prefix: str
) -> torch.Tensor | QuantizedWeight:
    import torch

    q, z = _integers(parts, scheme)  # [in, out] each: q per weight, z per group
    scales = parts["scales"]
    cols, rows = q.shape
    groups = z.shape[0]
    if scales.shape != z.shape or groups != (
        1 if scheme.group_size == -1 else -(-cols // scheme.group_size)
    ):
        raise ValueError(
            f"weight {prefix}: {scheme.method} scales {list(scales.shape)} and zeros "
            f"{list(z.shape)} do not fit {cols} inputs in groups of {scheme.group_size}"
        )
    group = _groups(parts, scheme, cols, prefix)
    trivial = bool(torch.equal(group, _plain_groups(scheme, cols)))
    if keep_quantized and trivial and cols % _BLOCK == 0:
        block_group = group[::_BLOCK]  # every block inside one group: trivial groups of 32k
        if scheme.group_size == -1 or scheme.group_size % _BLOCK == 0:
            blocks = _blocks(q, z, scales, block_group, scheme.bits)
            if blocks is not None:
                return blocks
    s = scales.to(torch.float32)
    return ((q - z[group]).to(torch.float32) * s[group]).T.contiguous()


def _integers(parts: dict[str, torch.Tensor], scheme: PackedScheme):
    """(q [in, out], z [groups, out]) as int32, unpacked and in column order."""
    import torch

    bits = scheme.bits
    if scheme.method == "gptq":
        q = _unpack(parts["qweight"], bits, dim=0)
        z = _unpack(parts["qzeros"], bits, dim=1)[:, : q.shape[1]] + scheme.zero_offset
        return q, z
    q = _unpack(parts["qweight"], bits, dim=1)
    z = _unpack(parts["qzeros"], bits, dim=1)
    # nibble k of word c holds column 8c + _AWQ_ORDER[k]: column 8c + j is nibble k = the
    # inverse permutation's j-th entry
    inverse = torch.argsort(torch.tensor(_AWQ_ORDER))
    index = (torch.arange(q.shape[1] // 8).unsqueeze(1) * 8 + inverse).view(-1)
    return q[:, index], z[:, index]


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values (low bits first), spread along `dim`."""
    import torch

    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
        return values.reshape(words.shape[0] * per, words.shape[1])
    values = (words.unsqueeze(2) >> shifts.view(1, 1, per)) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], words.shape[1] * per)


def _plain_groups(scheme: PackedScheme, cols: int) -> torch.Tensor:
    import torch

    columns = torch.arange(cols, dtype=torch.int32)
    return columns * 0 if scheme.group_size == -1 else columns // scheme.group_size


def _groups(
    parts: dict[str, torch.Tensor], scheme: PackedScheme, cols: int, prefix: str
) -> torch.Tensor:
    """Each input column's group: GPTQ's g_idx under act order, else column // group_size."""
    import torch

    if not scheme.act_order:
        return _plain_groups(scheme, cols)
    group = parts["g_idx"].to(torch.int32)
    if group.shape != (cols,):
        raise ValueError(f"weight {prefix}: g_idx {list(group.shape)} for {cols} inputs")
    return group


def _blocks(
    q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, block_group: torch.Tensor, bits: int
) -> QuantizedWeight | None:
    """Q4_1 (4-bit) or Q8_0 (8-bit with z = 128) rows [out, in / 32 * bytes] of the same values,
    or None where no GGUF block holds them."""
    import torch

    cols, rows = q.shape
    s = scales.to(torch.float32)[block_group].T  # [out, blocks]: each block's group's scale
    zero = z[block_group].T
    values = q.T.reshape(rows, cols // _BLOCK, _BLOCK)
    if bits == 4:
        d, m = s, -zero.to(torch.float32) * s
        head = torch.stack((d, m), dim=-1).to(torch.float16).view(torch.uint8)  # [out, nb, 4]
        nibbles = (values[..., :16] | (values[..., 16:] << 4)).to(torch.uint8)
        data, qtype = torch.cat((head, nibbles), -1), GGMLQuantizationType.Q4_1
    elif bool((zero == 128).all()):
        head = s.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [out, nb, 2]
        centred = (values - 128).to(torch.int8).view(torch.uint8)
        data, qtype = torch.cat((head, centred), -1), GGMLQuantizationType.Q8_0
    else:
        return None
    return QuantizedWeight(int(qtype), data.reshape(rows, -1).contiguous(), cols)
