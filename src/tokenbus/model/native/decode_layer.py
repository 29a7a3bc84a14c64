"""A whole decoder layer of a decode-sized step in one C call (decode_layer.c): a Llama-family
layer, with a dense or a sparse MoE MLP, Gemma's sandwich-norm layer with GeGLU, or Gemma 4's.

`DecodeLayers` holds one `layer` struct per decoder layer (decode_layer_weights.py: pointers
into the model's own tensors, so the model must outlive it) and runs a step over them;
`step_args` packs what a step shares (rotary rows, slots, the attention batch) into the `step`
struct, which mirrors kernels.h's field for field.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbus.model import kv_quant
from tokenbus.model.native import (
    KERNEL_DTYPES,
    TILE_ACTIVATIONS,
    FusedOps,
    PagedAttentionKernel,
    QuantKernels,
    load_library,
)
from tokenbus.model.native.decode_layer_weights import LayerWeights
from tokenbus.model.native.dense_rows import load_dense_rows
from tokenbus.model.native.signatures import bind
from tokenbus.utils.cpu import CpuFeatures

_SOURCE = Path(__file__).with_name("decode_layer.c")
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# The pool dtypes decode_layer.c writes (kv_quant.h): fp32, and rounded to fp16, fp8 or q8_0.
DECODE_LAYER_KV_DTYPES = (torch.float32, torch.float16, *kv_quant.QUANTIZED_KV_DTYPES)


class _Kernels(ctypes.Structure):
    _fields_ = [
        ("matmul", _PTR),
        ("attention", _PTR),
        ("add_rms_norm", _PTR),
        ("rope", _PTR),
        ("silu_mul", _PTR),
        ("gelu_tanh_mul", _PTR),
        ("dense_matmul", _PTR),
        ("clamped_swiglu_mul", _PTR),
    ]


class _KVGroup(ctypes.Structure):
    _fields_ = [("slots", _PTR), ("block_tables", _PTR), ("table_stride", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _I64),
        ("cos", _PTR),
        ("sin", _PTR),
        ("rotary_dim", _I64),
        ("rope_stride", _I64),
        ("rope_offsets", _PTR),
        ("rope_dims", _PTR),
        ("groups", ctypes.POINTER(_KVGroup)),
        ("layer_groups", _PTR),
        ("query_start", _PTR),
        ("seq_lens", _PTR),
        ("reqs", _PTR),
        ("num_reqs", _I64),
        ("num_blocks", _I64),
        ("block_size", _I64),
        ("activations", _I64),
        ("num_threads", _I64),
        ("k_activations", _I64),
        ("kv_elem", _I64),
        ("k_scale", _F32),
        ("v_scale", _F32),
        ("lora_slots", _PTR),
        ("q_scale", _PTR),
        ("per_layer_inputs", _PTR),
        ("per_layer_stride", _I64),
    ]


@dataclass(frozen=True)
class _RopeTables:
    """A step's rotary tables as decode_layer.c reads them: cos and sin, R tables at `stride`
    values apart, each turning rotary_dim values; or, tables of several sizes, at `offsets`
    (int64 [R]) turning `dims` (int64 [R]). `turns`: each table's turned values."""

    cos: torch.Tensor
    sin: torch.Tensor
    turns: tuple[int, ...]
    rotary_dim: int
    stride: int
    offsets: torch.Tensor | None = None
    dims: torch.Tensor | None = None

    @classmethod
    def of(
        cls, cos: torch.Tensor | Sequence[torch.Tensor], sin: torch.Tensor | Sequence[torch.Tensor]
    ) -> _RopeTables:
        if isinstance(cos, torch.Tensor):
            assert cos.is_contiguous() and sin.is_contiguous()
            stacked = cos.dim() == 4
            count, stride = (cos.shape[0], cos.stride(0)) if stacked else (1, 0)
            return cls(cos, sin, (2 * cos.shape[-1],) * count, 2 * cos.shape[-1], stride)
        assert all(table.dtype == torch.float32 for table in (*cos, *sin))
        sizes = [table.numel() for table in cos]
        starts = [sum(sizes[:r]) for r in range(len(sizes))]
        turns = tuple(2 * table.shape[-1] for table in cos)
        return cls(
            torch.cat([table.reshape(-1) for table in cos]),
            torch.cat([table.reshape(-1) for table in sin]),
            turns,
            0,
            0,
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(turns, dtype=torch.int64),
        )


def _check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"decode_layer: a kernel failed with status {status}")


def _address(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeLayers:
    """The model's decoder layers as decode_layer.c structs, and the call that runs one."""

    def __init__(
        self,
        layers: list[LayerWeights],
        quant: QuantKernels,
        attention: PagedAttentionKernel,
        fused: FusedOps,
        cpu: CpuFeatures | None = None,
    ) -> None:
        lib = load_library(_SOURCE, cpu)
        self._fn = bind(lib, "decode_layer")
        self._all_fn = bind(lib, "decode_layers")
        routers = load_dense_rows(cpu) if any(layer.moe for layer in layers) else None
        self._kernels = _Kernels(
            _address(quant.tile_fns["matmul"]),
            _address(attention.fn),
            _address(fused.add_rms_norm_fn),
            _address(fused.rope_fn),
            _address(fused.silu_mul_fn),
            _address(fused.gelu_tanh_mul_fn),
            None if routers is None else _address(routers.matmul_fn),
            _address(fused.clamped_swiglu_mul_fn),
        )
        self._weights = layers  # keeps every tensor the structs point into alive
        # and the objects behind the function pointers
        self._libraries = (quant, attention, fused, routers)
        self._layers = [layer.struct() for layer in layers]
        self._kernels_ref = ctypes.byref(self._kernels)
        self._layer_refs = [ctypes.byref(layer) for layer in self._layers]
        self._layer_array = (_PTR * len(self._layers))(
            *(ctypes.addressof(layer) for layer in self._layers)
        )
        self.hidden = layers[0].qkv.cols
        self.num_rope_tables = 1 + max(layer.rope_table for layer in layers)
        joins = {layer.per_layer_input.gate.rows for layer in layers if layer.per_layer_input}
        if len(joins) > 1:
            raise ValueError(f"decode_layer: per-layer inputs of several widths {sorted(joins)}")
        self.per_layer_width = joins.pop() if joins else None
        self._checked_turns: set[tuple[int, ...]] = set()  # the rotary sizes _check_turns passed
        # The engine's KV layout, as each step's ForwardContext.layer_groups gives it (fixed for
        # an engine's life: one tensor per layout seen, built once).
        self._layer_groups: dict[tuple[int, ...], torch.Tensor] = {}

    def step_args(
        self,
        num_tokens: int,
        cos: torch.Tensor | Sequence[torch.Tensor],
        sin: torch.Tensor | Sequence[torch.Tensor],
        groups: Sequence[tuple[torch.Tensor, torch.Tensor]],
        layer_groups: tuple[int, ...],
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        reqs: torch.Tensor,
        kv_cache: torch.Tensor,
        activations: str,
        k_activations: str,
        lora_slots: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        per_layer_inputs: torch.Tensor | None = None,
    ) -> _Step:
        """What every layer of this step shares. The tensors must live until the step ends
        (the caller's context holds them); cos/sin [T, 1, D/2], or R tables stacked [R, T, 1,
        D/2] (LayerWeights.rope_table picks one), contiguous fp32, or a sequence of R tables
        [T, 1, D_r/2] of their own sizes (Gemma 4's; copied into one buffer the step holds);
        per_layer_inputs [T, L, P] contiguous fp32 where layers join them; `groups` each KV group's
        (slot_mapping [T], block_tables [reqs, width]), and `layer_groups` each layer's group
        (ForwardContext.layer_groups; empty: all group 0); the index tensors int64, contiguous
        (as the attention plans checked them); lora_slots [T] int64, each row's LoRA slot (-1:
        none), or None; q_scale [T] fp32 (any shape of T values, contiguous), each token's query
        scale after the rotary, or None."""
        assert q_scale is None or (q_scale.is_contiguous() and q_scale.dtype == torch.float32)
        assert kv_cache.dtype in DECODE_LAYER_KV_DTYPES
        rope = _RopeTables.of(cos, sin)
        tables = len(rope.turns)
        self._check_per_layer_inputs(num_tokens, per_layer_inputs)
        if (
            tables < self.num_rope_tables
            or len(groups) <= max(layer_groups, default=0)
            or min(layer_groups, default=0) < 0  # a layer of no group (holding no K/V)
            or 0 < len(layer_groups) < len(self._layers)
        ):
            raise ValueError(
                f"decode_layer: the layers read {self.num_rope_tables} rotary tables and KV "
                f"groups {sorted(set(layer_groups))}; this step has {tables} and {len(groups)}"
            )
        self._check_turns(rope.turns)
        _, num_blocks, block_size, _, _ = kv_cache.shape
        for slots, _ in groups:
            assert slots.is_contiguous() and slots.dtype == torch.int64
            written = slots[:num_tokens]
            if num_tokens and (
                int(written.min()) < 0 or int(written.max()) >= num_blocks * block_size
            ):
                raise ValueError(
                    f"slot_mapping outside the KV cache's {num_blocks * block_size} slots"
                )
        layer_map = None
        if layer_groups:
            layer_map = self._layer_groups.get(layer_groups)
            if layer_map is None:
                layer_map = torch.tensor(layer_groups, dtype=torch.int64)
                self._layer_groups[layer_groups] = layer_map
        views = [_KVGroup(s.data_ptr(), t.data_ptr(), t.stride(0)) for s, t in groups]
        step = _Step(
            num_tokens,
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
            rope.rotary_dim,
            rope.stride,
            None if rope.offsets is None else rope.offsets.data_ptr(),
            None if rope.dims is None else rope.dims.data_ptr(),
            (_KVGroup * len(views))(*views),
            None if layer_map is None else layer_map.data_ptr(),
            query_start.data_ptr(),
            seq_lens.data_ptr(),
            reqs.data_ptr(),
            reqs.numel(),
            num_blocks,
            block_size,
            TILE_ACTIVATIONS[activations],
            torch.get_num_threads(),
            TILE_ACTIVATIONS[k_activations],
            KERNEL_DTYPES[kv_cache.dtype],
            *kv_quant.tensor_scales(kv_cache.dtype),
            None if lora_slots is None else lora_slots.data_ptr(),
            None if q_scale is None else q_scale.data_ptr(),
            None if per_layer_inputs is None else per_layer_inputs.data_ptr(),
            0 if per_layer_inputs is None else per_layer_inputs[0].numel(),
        )
        step.rope = rope  # the tables it points into, where they were copied for it
        return step

    def _check_turns(self, turns: tuple[int, ...]) -> None:
        """C turns each head of a layer by its table's values (rotate-half pairs): refuse a
        table wider than a layer's heads, or of an odd count. Checked once per set of sizes."""
        if turns in self._checked_turns:
            return
        for index, layer in enumerate(self._weights):
            if layer.mla is not None:  # latent attention turns its own rope_dim
                continue
            turned = turns[layer.rope_table]
            if turned > layer.head_dim or turned % 2:
                raise ValueError(
                    f"decode_layer: layer {index} turns {turned} of its heads' {layer.head_dim} "
                    "values"
                )
        self._checked_turns.add(turns)

    def _check_per_layer_inputs(self, num_tokens: int, inputs: torch.Tensor | None) -> None:
        """C reads layer i's P inputs of token t from [T, L, P]: refuse another shape."""
        if self.per_layer_width is None:
            return
        want = [num_tokens, len(self._layers), self.per_layer_width]
        if (
            inputs is None
            or inputs.dtype != torch.float32
            or not inputs.is_contiguous()
            or list(inputs.shape) != want
        ):
            got = None if inputs is None else f"{inputs.dtype} {list(inputs.shape)}"
            raise ValueError(f"decode_layer: per-layer inputs fp32 {want} needed, got {got}")

    def run(
        self,
        index: int,
        step: _Step,
        kv_cache: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        x_out: torch.Tensor,
        residual_out: torch.Tensor,
    ) -> None:
        """Layer `index` on x [T, hidden] (fp32, contiguous): x_out = its MLP output, residual_out
        = the residual stream after its attention (x_out may be x, residual_out residual); a
        layer whose output is whole (LayerWeights.layer_scalar) gives it all in x_out, and
        zeros in residual_out."""
        _check(
            self._fn(
                self._kernels_ref,
                self._layer_refs[index],
                index,
                ctypes.byref(step),
                kv_cache.data_ptr(),
                x.data_ptr(),
                None if residual is None else residual.data_ptr(),
                x_out.data_ptr(),
                residual_out.data_ptr(),
            )
        )

    def run_all(
        self,
        num_layers: int,
        step: _Step,
        kv_caches: list[torch.Tensor],
        x: torch.Tensor,
        residual_out: torch.Tensor,
    ) -> None:
        """Layers 0 .. num_layers - 1 in one C call, as `run` one after another would: x [T,
        hidden] in place (the last layer's MLP output), residual_out the residual stream after
        the last layer's attention."""
        caches = (_PTR * num_layers)(*(kv_caches[i].data_ptr() for i in range(num_layers)))
        _check(
            self._all_fn(
                self._kernels_ref,
                self._layer_array,
                num_layers,
                ctypes.byref(step),
                caches,
                x.data_ptr(),
                residual_out.data_ptr(),
            )
        )
