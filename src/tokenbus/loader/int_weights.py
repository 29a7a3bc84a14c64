"""Integer-quantized safetensors (L2): GPTQ, AWQ and compressed-tensors' integer formats, whose
linears hold 4- or 8-bit integers with a scale (and a zero point) per group of input columns,
read as the GGUF blocks that hold the same values exactly where they can, else as fp32.

Every layout stores, for a linear of [out, in], value = (q - z) * s, with s and z those of the
input column's group (here q and z unsigned: q in [0, 2^bits)). Their tensors (words int32,
each value's low bits first):
- GPTQ (AutoGPTQ, GPTQModel; Qwen's -GPTQ-Int4/Int8 releases): `qweight` [in / pack, out] packs
  input rows; `qzeros` [groups, out / pack] packs output columns and, in the original
  `checkpoint_format` "gptq", holds z - 1 (`gptq_v2`: z); `scales` [groups, out]; `g_idx` [in]
  each input column's group (`desc_act`: reordered, else i // group_size);
- AWQ, its `gemm` version (AutoAWQ; Qwen's -AWQ releases): `qweight` [in, out / 8] and
  `qzeros` [groups, out / 8] both pack output columns, nibble k of word c holding column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[k]; `scales` [groups, out];
- compressed-tensors (llm-compressor's W4A16, W8A16 and W8A8 releases): `pack-quantized`'s
  `weight_packed` [out, in / pack] packs input columns of signed values stored plus 2^(bits-1),
  `weight_zero_point` (asymmetric only) [out / pack, groups] packs output rows the same way,
  `weight_scale` [out, groups] (a `channel` strategy: one group), `weight_g_idx` under a group
  act order, `weight_shape` the unpadded [out, in]; `int-quantized` keeps `weight` as int8 [out,
  in] beside its `weight_scale`, symmetric. Their activation scales are dropped.

Kept quantized (`--quantization` auto on CPU, as for FP8 checkpoints), a 4-bit matrix whose
groups hold whole 32-column blocks becomes GGUF Q4_1 (each block: d = s, m = -z * s, its q as
they are): exact where d and m are fp16 values (GPTQ's and AWQ's scales are fp16; a symmetric
layout's m = -8s; compressed-tensors' bf16 scales convert exactly down to 2^-14), else rounded
once to fp16. An 8-bit symmetric one (z = 128) becomes Q8_0 (d = s, q - 128), alike. Any
other (act-order groups, 8-bit asymmetric) comes as fp32 and is rounded to Q8_0 with the dense
weights. The embedding and LM head, unquantized in these files, load as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

from tokenbus.loader.gguf_loader import QuantizedWeight, q8_0_weight

if TYPE_CHECKING:
    import torch

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds, within its 8: this column
_BLOCK = 32  # GGUF Q4_1 / Q8_0 values a block
_CT_FORMATS = ("pack-quantized", "int-quantized")
# activation and KV-cache scales (llm-compressor's older files: a KV `output_scale`): unread
_CT_DROPPED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class PackedScheme:
    """An integer checkpoint's layout. `method`: gptq, awq, or compressed-tensors' format
    (pack-quantized, int-quantized). `group_size` -1: one group a row. `act_order`: groups by
    the file's g_idx. `zero_offset`: what GPTQ's original format subtracted from each stored
    zero (1). `symmetric`: compressed-tensors stores no zero point (z = 2^(bits-1))."""

    method: str
    bits: int
    group_size: int
    act_order: bool = False
    zero_offset: int = 0
    symmetric: bool = False

    def parts(self) -> tuple[set[str], set[str]]:
        """(the tensor leaves a linear needs, those it may also have)."""
        if self.method == "gptq":
            needed = {"qweight", "qzeros", "scales"}
            return needed | ({"g_idx"} if self.act_order else set()), {"g_idx"}
        if self.method == "awq":
            return {"qweight", "qzeros", "scales"}, set()
        if self.method == "int-quantized":
            return {"weight", "weight_scale"}, set()
        needed = {"weight_packed", "weight_scale", "weight_shape"}
        needed |= set() if self.symmetric else {"weight_zero_point"}
        return needed | ({"weight_g_idx"} if self.act_order else set()), {"weight_g_idx"}


def packed_scheme(config: dict[str, Any], path: object) -> PackedScheme | None:
    """The integer layout config.json's `quantization_config` names, None for other methods
    (and compressed-tensors' FP8 format: loader/fp8.py); a layout this reader does not know
    (3-bit, AWQ's gemv packing, Marlin's, a compressed-tensors format not above) is a
    ValueError naming the field."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return None
    method = quantization.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quantization, path)
    if method not in ("gptq", "awq"):
        return None
    bits = quantization.get("bits", quantization.get("w_bit"))
    group_size = quantization.get("group_size", quantization.get("q_group_size", 128))
    _check_bits(bits, (4, 8) if method == "gptq" else (4,), method, path)
    _check_group_size(group_size, path)
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
    words = str(quantization.get("pack_dtype", "int32")).removeprefix("torch.")
    if words != "int32":  # GPTQModel may pack into other words
        raise ValueError(f"{path}: quantization_config pack_dtype {words!r} (gptq): int32 read")
    act_order = bool(quantization.get("desc_act"))
    return PackedScheme(method, bits, group_size, act_order, int(fmt == "gptq"))


def _compressed_tensors(quantization: dict[str, Any], path: object) -> PackedScheme | None:
    fmt = quantization.get("format")
    if fmt == "float-quantized":
        return None  # FP8: loader/fp8.py
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"{path}: quantization_config format {fmt!r} (compressed-tensors) is not supported: "
            f"'float-quantized' (FP8) and {', '.join(map(repr, _CT_FORMATS))} are read; load "
            "the model's GGUF for others"
        )
    schemes = set()
    for name, group in (quantization.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type", "int") != "int":
            raise ValueError(f"{path}: config_groups.{name}.weights type {weights.get('type')!r}")
        bits, strategy = weights.get("num_bits"), weights.get("strategy")
        _check_bits(bits, (4, 8) if fmt == "pack-quantized" else (8,), fmt, path)
        symmetric = bool(weights.get("symmetric", True))
        if strategy == "group":
            group_size = weights.get("group_size")
            _check_group_size(group_size, path)
        elif strategy in ("channel", "tensor"):
            group_size = -1
        else:
            raise ValueError(f"{path}: config_groups.{name}.weights strategy {strategy!r}")
        if not symmetric and (fmt == "int-quantized" or strategy == "tensor"):
            raise ValueError(
                f"{path}: config_groups.{name}.weights: asymmetric {fmt} by {strategy} "
                "(zero points are read packed, by group or channel)"
            )
        act_order = weights.get("actorder") == "group"
        schemes.add(PackedScheme(fmt, bits, group_size, act_order, symmetric=symmetric))
    if len(schemes) != 1:
        raise ValueError(
            f"{path}: quantization_config config_groups: one weights scheme is read, "
            f"got {len(schemes)}"
        )
    return schemes.pop()


def _check_bits(bits: Any, allowed: tuple[int, ...], method: str, path: object) -> None:
    if bits not in allowed:
        raise ValueError(f"{path}: quantization_config bits {bits!r} ({method}): {allowed} read")


def _check_group_size(group_size: Any, path: object) -> None:
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{path}: quantization_config group_size {group_size!r}")


def unpacked(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: PackedScheme, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each quantized linear's parts (PackedScheme.parts) as `<linear>.weight`: GGUF blocks
    (keep_quantized, where exact as the module says) or fp32 [out, in]; a linear waits for
    all of its parts (shards may split them). Other tensors pass. A part left without the
    rest is a ValueError naming it."""
    needed, optional = scheme.parts()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dropped = _CT_DROPPED if scheme.method in _CT_FORMATS else ()
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in dropped:
            continue
        # a float `weight`: a linear the config left unquantized (int-quantized's are int8)
        if leaf not in needed | optional or (leaf == "weight" and tensor.dtype.is_floating_point):
            yield name, tensor
            continue
        if leaf in optional - needed:  # g_idx without act order: column // group_size
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            del pending[prefix]
            yield f"{prefix}.weight", _linear(parts, scheme, keep_quantized, prefix)
    for prefix, parts in pending.items():
        missing = ", ".join(sorted(needed - parts.keys()))
        raise ValueError(f"weight {prefix}: {scheme.method} parts without {missing}")


def _linear(
    parts: dict[str, torch.Tensor], scheme: PackedScheme, keep_quantized: bool, prefix: str
) -> torch.Tensor | QuantizedWeight:
    import torch

    q, z, scales = _integers(parts, scheme, prefix)  # [in, out], [groups, out], [groups, out]
    cols = q.shape[0]
    groups = 1 if scheme.group_size == -1 else -(-cols // scheme.group_size)
    if scales.shape != z.shape or z.shape != (groups, q.shape[1]):
        raise ValueError(
            f"weight {prefix}: {scheme.method} scales {list(scales.shape)} and zeros "
            f"{list(z.shape)} do not fit {cols} inputs in groups of {scheme.group_size}"
        )
    group = _groups(parts, scheme, cols, prefix)
    plain = bool(torch.equal(group, _plain_groups(scheme, cols)))
    # every 32-value block inside one group: groups of 32k columns (or one a row)
    whole_blocks = scheme.group_size == -1 or scheme.group_size % _BLOCK == 0
    if keep_quantized and plain and whole_blocks and cols % _BLOCK == 0:
        blocks = _blocks(q, z, scales, group[::_BLOCK], scheme.bits)
        if blocks is not None:
            return blocks
    s = scales.to(torch.float32)
    return ((q - z[group]).to(torch.float32) * s[group]).T.contiguous()


def _integers(parts: dict[str, torch.Tensor], scheme: PackedScheme, prefix: str):
    """(q [in, out], z [groups, out], scales [groups, out]): q and z unsigned, in column
    order."""
    import torch

    bits = scheme.bits
    if scheme.method == "gptq":
        q = _unpack(parts["qweight"], bits, dim=0)
        z = _unpack(parts["qzeros"], bits, dim=1)[:, : q.shape[1]] + scheme.zero_offset
        return q, z, parts["scales"]
    if scheme.method == "awq":
        q = _unpack(parts["qweight"], bits, dim=1)
        z = _unpack(parts["qzeros"], bits, dim=1)
        # nibble k of word c holds column 8c + _AWQ_ORDER[k]: column 8c + j is the nibble
        # the inverse permutation names
        inverse = torch.argsort(torch.tensor(_AWQ_ORDER))
        index = (torch.arange(q.shape[1] // 8).unsqueeze(1) * 8 + inverse).view(-1)
        return q[:, index], z[:, index], parts["scales"]
    offset = 1 << (bits - 1)  # compressed-tensors' signed values, stored plus 2^(bits-1)
    scales = parts["weight_scale"]
    if scheme.method == "int-quantized":
        q = parts["weight"].to(torch.int32).T + offset  # int8 [out, in]
    else:
        rows, cols = (int(v) for v in parts["weight_shape"])
        q = _unpack(parts["weight_packed"], bits, dim=1)[:rows, :cols].T
    if scales.dim() < 2:  # one scale for the matrix (strategy tensor)
        scales = scales.reshape(1, 1).expand(q.shape[1], 1)
    if scheme.symmetric:
        z = torch.full((scales.shape[1], q.shape[1]), offset, dtype=torch.int32)
    else:
        z = _ct_zero_points(parts["weight_zero_point"], bits, tuple(scales.shape), prefix)
    return q, z, scales.T


def _ct_zero_points(
    zero: torch.Tensor, bits: int, grid: tuple[int, int], prefix: str
) -> torch.Tensor:
    """compressed-tensors' zero points [out, groups] as unsigned z [groups, out]: packed
    along the rows in int32 words (signed values plus 2^(bits-1): unsigned, z itself), or,
    as files written before it packed them, int8 signed values."""
    import torch

    rows, groups = grid
    per = 32 // bits
    if zero.dtype == torch.int32 and zero.shape == (-(-rows // per), groups):
        return _unpack(zero, bits, dim=0)[:rows].T
    if zero.dtype == torch.int8 and zero.shape == grid:
        return (zero.to(torch.int32) + (1 << (bits - 1))).T
    raise ValueError(
        f"weight {prefix}: weight_zero_point {zero.dtype} {list(zero.shape)} is neither "
        f"int32 words [{-(-rows // per)}, {groups}] nor int8 [{rows}, {groups}]"
    )


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
    """Each input column's group: the file's g_idx under act order, else column // size."""
    import torch

    if not scheme.act_order:
        return _plain_groups(scheme, cols)
    name = "g_idx" if scheme.method == "gptq" else "weight_g_idx"
    group = parts[name].to(torch.int32)
    if group.shape != (cols,):
        raise ValueError(f"weight {prefix}: {name} {list(group.shape)} for {cols} inputs")
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
        return q8_0_weight(s, (values - 128).reshape(rows, cols))
    else:
        return None
    return QuantizedWeight(int(qtype), data.reshape(rows, -1).contiguous(), cols)
