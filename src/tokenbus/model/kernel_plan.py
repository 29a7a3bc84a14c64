"""Which kernel runs each part of a step: chosen once, at load, here (L2).

Model files describe an architecture (model/decoder.py's parts, a family file choosing them);
they choose no kernel. As vLLM's get_attn_backend picks an attention backend once from the
device, dtype and flags, and gpt-fast applies quantization and tensor parallelism to a model
from outside, `apply_kernels(model, request)` picks, for the model's device, dtype and this CPU:

- the elementwise ops every norm, attention and MLP calls (layers/ops.py): fused_ops.c on CPU in
  fp32 where it builds, torch otherwise;
- each linear's kernel (layers/linear.py): packed oneDNN, plain F.linear, dense_rows.c
  (--batch-invariant), or the GGUF blocks on the native kernels (weights kept quantized), and
  how tiled blocks take their activations (TileModes: `quant_activation_modes`);
- the embedding's blocks, where it was kept quantized;
- the attention backend (attention_backend.select_attention_backend);
- on CUDA with the Triton backend, MoE experts stacked for triton_moe.py's grouped GEMMs
  (`_stack_moe_experts`);
- decode_layer.c over every decoder layer, where each layer can run there (`decode_layers`:
  pre-norm and sandwich-norm layers, SiLU or GeGLU, dense or MoE, Gemma 4's, each with its
  window, rotary table and KV group: model/c_layers.py).

The result is a frozen KernelPlan the model holds; `KernelPlan.run_layers` is the one place a
step's route is decided: all layers in one C call (a decode-sized step whose attention is all
the native kernel's decode path), one C call per layer (the same, with a KV connector's hooks
between layers), or each layer op by op. A new family whose layers are the shared parts gets
every one of these paths without a line of kernel code.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokenbus.model.attention import AttentionPlan
from tokenbus.model.attention_backend import (
    AttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
    select_attention_backend,
)
from tokenbus.model.c_layers import build_decode_layers
from tokenbus.model.decoder import DecoderLayer
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.layers import TORCH_OPS, FusedCpuOps, Linear, OpsModule, TorchOps
from tokenbus.model.layers.quantized import (
    BF16_AUTO_MIN_ROWS,
    GEMM_FROM_ROWS,
    INT8_K_QUANT_ISAS,
    INT_TILES_ANY_ROWS_ISAS,
    Q8_K_AUTO_MIN_ROWS,
    DequantBuffer,
    QuantizedLinearKernel,
    TileModes,
)
from tokenbus.model.lora import LoRABatch
from tokenbus.model.moe import SparseMoeBlock
from tokenbus.model.native import (
    TILE_GEMV_MAX_ROWS,
    NativeBuildError,
    QuantKernels,
    load_fused_ops,
    load_quant_kernels,
)
from tokenbus.model.native.decode_layer import DECODE_LAYER_KV_DTYPES, DecodeLayers
from tokenbus.utils.cpu import CpuFeatures

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelRequest:
    """What the configuration asks of the kernels (ModelConfig, CompilationConfig)."""

    attention_backend: str = "auto"  # ModelConfig.attention_backend
    linear_backend: str = "auto"  # layers/linear.LINEAR_BACKENDS (benchmarks compare them)
    decode_layers: bool = True  # False (--enforce-eager): every step op by op
    batch_invariant: bool = False  # ModelConfig.batch_invariant
    # ModelConfig.quant_activations; None: no weights are kept in GGUF blocks
    quant_activations: str | None = None


@dataclass(frozen=True)
class KernelPlan:
    """The kernels a model runs with, and the route of each step (run_layers)."""

    request: KernelRequest
    ops: TorchOps  # the elementwise ops bound to every OpsModule
    attention: AttentionBackend  # builds each step's attention metadata (the worker asks it)
    quant: QuantKernels | None = None  # the GGUF blocks' kernels, where weights are kept so
    tile_modes: TileModes = TileModes()  # how tiled blocks take x (the linears hold the same)
    decode_layers: DecodeLayers | None = None  # decode_layer.c over every layer, or None
    lora: LoRABatch | None = None  # which rows use which adapter (worker/lora_slots.py)

    @classmethod
    def portable(cls, dtype: torch.dtype) -> KernelPlan:
        """The torch path everywhere: a model's plan until apply_kernels chooses."""
        return cls(
            KernelRequest("torch", "dense", decode_layers=False),
            TORCH_OPS,
            TorchAttentionBackend(dtype),
        )

    def without_decode_layers(self) -> KernelPlan:
        return dataclasses.replace(self, decode_layers=None)

    def with_decode_layers(self, model: nn.Module) -> KernelPlan:
        """This plan with decode_layer.c over `model`'s layers, where they can run there."""
        layers = build_decode_layers(model, self.ops, self.attention, self.quant)
        return dataclasses.replace(self, decode_layers=layers)

    def run_layers(
        self,
        layers: Sequence[DecoderLayer],
        num_layers: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        q_scale: torch.Tensor | None = None,
        carry: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """layers[:num_layers] over x [T, hidden]: (the last layer's output, the residual
        stream), for the model's final add-and-norm; `q_scale` each token's query scale
        (CausalLM.query_scale) or None. Each layer takes and gives back two tensors: x and
        the residual stream, None before the first layer; a family whose layers pass another
        tensor along in the residual's place (Gemma 3n's and Gemma 4's per-layer inputs) hands
        the first layer that as `carry`. In C such layers (Gemma 4's) read it as their
        per-layer inputs and give their whole output as x, the residual stream zeros."""
        step = self._decode_step(x, cos, sin, ctx, q_scale, carry)
        connector = ctx.kv_connector
        if step is not None and connector is None:  # every layer in one C call
            residual = torch.empty_like(x)
            self.decode_layers.run_all(num_layers, step, ctx.kv_caches, x, residual)
            return x, residual
        residual = carry if step is None else None
        for layer_idx in range(num_layers):
            if connector is not None:
                connector.wait_for_layer_load(layer_idx)
            if step is not None:  # the whole layer in one C call, x and residual updated in place
                out = residual if residual is not None else torch.empty_like(x)
                self.decode_layers.run(
                    layer_idx, step, ctx.kv_caches[layer_idx], x, residual, x, out
                )
                residual = out
            else:
                slot_mapping, attn_metadata = ctx.layer_inputs(layer_idx)  # its KV group's
                x, residual = layers[layer_idx](
                    x,
                    residual,
                    cos,
                    sin,
                    ctx.kv_caches[layer_idx],
                    slot_mapping,
                    attn_metadata,
                    q_scale,
                )
            if connector is not None:
                connector.save_kv_layer(layer_idx, ctx.kv_caches[layer_idx])
        return x, residual

    def _decode_step(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        q_scale: torch.Tensor | None = None,
        carry: torch.Tensor | None = None,
    ):
        """decode_layer.c's step arguments when this step runs there: a decode-sized batch
        whose attention, in every KV group (a hybrid cache: one per window), is all the native
        kernel's decode path, over a pool it writes; else None. (fp32, CPU, tiled weights and
        the native kernel were settled at load.) `carry`: run_layers'; the layers' per-layer
        inputs where they join them."""
        layers, rows = self.decode_layers, x.shape[0]
        if layers is None or rows > TILE_GEMV_MAX_ROWS:
            return None
        plans = [ctx.attn_metadata, *(group.attn_metadata for group in ctx.kv_groups)]
        if not all(isinstance(p, AttentionPlan) and p.native_decode_only(rows) for p in plans):
            return None
        kv = ctx.first_kv_cache
        if kv.dtype not in DECODE_LAYER_KV_DTYPES or not kv.is_contiguous():
            return None
        slots = [ctx.slot_mapping, *(group.slot_mapping for group in ctx.kv_groups)]
        native = plans[0].native  # what the groups share: the batch's requests and lengths
        return layers.step_args(
            rows,
            cos,
            sin,
            [(s, plan.native.block_tables) for s, plan in zip(slots, plans, strict=True)],
            ctx.layer_groups,
            native.query_start,
            native.seq_lens,
            native.reqs,
            kv,
            self.tile_modes.mode(rows),
            self.tile_modes.mode(rows, k_quant=True),
            self.lora.slots if self.lora is not None else None,
            q_scale,
            carry if layers.per_layer_width is not None else None,
        )


def apply_kernels(
    model: nn.Module, request: KernelRequest = KernelRequest(), cpu: CpuFeatures | None = None
) -> KernelPlan:
    """Choose every kernel of a loaded `model` (a causal_lm.CausalLM), bind them, and return
    the plan the model now holds. Choosing again (another request) is allowed: weights kept in
    GGUF blocks stay on them."""
    cpu = cpu or CpuFeatures.detect()
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    attention = select_attention_backend(
        request.attention_backend, device, dtype, request.batch_invariant
    )
    _stack_moe_experts(model, device, attention)
    quant = _finalize_weights(model, request, cpu)
    modes = TileModes()
    if request.quant_activations is not None:
        modes = quant_activation_modes(request.quant_activations, quant, request.batch_invariant)
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.kernel, QuantizedLinearKernel):
            module.kernel.modes = modes
    plan = KernelPlan(
        request, _layer_ops(device, dtype, cpu), attention, quant, modes, lora=model.kernels.lora
    )
    if request.decode_layers:
        plan = plan.with_decode_layers(model)
    _install(model, plan)
    return plan


def attach_lora(model: nn.Module, batch: LoRABatch) -> None:
    """Adapters are on (worker/lora_slots.py gave every linear its slots): the plan carries the
    step's rows, and the C layers are rebuilt to read the slots too."""
    plan = dataclasses.replace(model.kernels, lora=batch)
    if plan.decode_layers is not None:
        plan = plan.with_decode_layers(model)
    _install(model, plan)


def _install(model: nn.Module, plan: KernelPlan) -> None:
    """The model holds the plan, and every norm, attention and MLP of it calls the plan's ops."""
    for module in model.modules():
        if isinstance(module, OpsModule):
            module.ops = plan.ops
    model.kernels = plan


def _stack_moe_experts(model: nn.Module, device: torch.device, attention: AttentionBackend) -> None:
    """On CUDA with the Triton backend (the default there), MoE blocks whose experts are dense
    run them through triton_moe.py's grouped GEMMs, which read nothing back to the host, so
    their steps can be captured (worker/captured_step.py). `--attention-backend torch` keeps
    every step in torch (where Triton cannot run, say); elsewhere experts run one by one.
    (Experts on CUDA are dense: GGUF blocks are kept on CPU only, engine/setup.py's
    quantization_problem.)"""
    if device.type != "cuda" or not isinstance(attention, TritonAttentionBackend):
        return
    for module in model.modules():
        if isinstance(module, SparseMoeBlock) and module.stackable:
            module.stack_experts()


def _layer_ops(device: torch.device, dtype: torch.dtype, cpu: CpuFeatures) -> TorchOps:
    """fused_ops.c on CPU in fp32 (one C call per step instead of 3-6 ATen ops), where it
    builds; torch otherwise."""
    if device.type != "cpu" or dtype != torch.float32:
        return TORCH_OPS
    try:
        return FusedCpuOps(load_fused_ops(cpu))
    except NativeBuildError as exc:
        logger.warning("fused CPU ops unavailable, torch runs them: %s", exc)
        return TORCH_OPS


def _finalize_weights(
    model: nn.Module, request: KernelRequest, cpu: CpuFeatures
) -> QuantKernels | None:
    """Each linear's kernel (layers/linear.py: GGUF blocks on the native kernels, else packed
    for the device and CPU, or dense_rows.c under batch invariance, whose rows never depend on
    each other), and the embedding's blocks; the quantized kernels, where weights use them."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    on_blocks = bool(model.quantized_tables()) or any(
        linear.quantized or linear.backend == "gguf" for linear in linears
    )
    quant = load_quant_kernels(cpu) if on_blocks else None
    backend = "rows" if request.batch_invariant else request.linear_backend
    buffer = DequantBuffer()  # one scratch for all linears: they run one at a time
    for linear in linears:
        linear.finalize(backend, cpu, quant, buffer)
    model.finalize_tables(quant)
    return quant


def quant_activation_modes(
    requested: str, kernels: QuantKernels | None, row_invariant: bool = False
) -> TileModes:
    """The TileModes for a ModelConfig.quant_activations: auto is int16, and bf16 from
    BF16_AUTO_MIN_ROWS[engine] rows where the CPU has a bf16 engine (AMX: prefill chunks and
    decode batches of 16+; AVX512-BF16: prefill chunks), else int16 at any size on
    INT_TILES_ANY_ROWS_ISAS (AVX2, AVX-512); without AMX but with q8_k's kernels (AVX-512
    VNNI), calls on K-quant tiles from Q8_K_AUTO_MIN_ROWS rows take q8_k (llama.cpp's pairing:
    Q8_K activations for K-quant weights), and on INT8_K_QUANT_ISAS (AVX2, with neither q8_k
    nor bf16) int8. bf16 and q8_k are that mode for every call and need
    their kernels; an explicit int8 or int16 takes its tiles at any size where
    auto's int16 does, and int8 wherever q8_k runs (VNNI: int8 tiles by pairs, ahead of the
    GEMM). Calls past the decode-sized ones dequantize for the fp32 GEMM otherwise.
    `row_invariant` (--batch-invariant): one mode at every size (auto: int16), on the block
    kernels only (TileModes.row_invariant)."""
    engine = kernels.bf16_engine if kernels is not None else ""
    q8_k = kernels is not None and kernels.q8_k
    any_rows = not engine and kernels is not None and kernels.isa in INT_TILES_ANY_ROWS_ISAS
    if requested == "bf16":
        if not engine:
            raise ValueError(
                "quant_activations 'bf16' needs AVX512-BF16 (avx512_bf16; AMX tiles where the "
                f"kernel grants them); this CPU: {CpuFeatures.detect().describe()}"
            )
        return TileModes("bf16", 1, 0, row_invariant)
    if requested == "q8_k":
        if not q8_k:
            raise ValueError(
                "quant_activations 'q8_k' needs AVX-512 with VNNI (avx512_vnni); this CPU: "
                f"{CpuFeatures.detect().describe()}"
            )
        return TileModes("q8_k", 0, 0, row_invariant)
    if row_invariant:
        return TileModes("int16" if requested == "auto" else requested, 0, 0, True)
    if requested == "auto":
        k_quant_mode = "q8_k" if q8_k and engine != "amx" else ""
        if not q8_k and not engine and kernels is not None and kernels.isa in INT8_K_QUANT_ISAS:
            k_quant_mode = "int8"
        return TileModes(
            "int16",
            BF16_AUTO_MIN_ROWS.get(engine, 0),
            0 if any_rows else GEMM_FROM_ROWS,
            k_quant_from_rows=Q8_K_AUTO_MIN_ROWS if k_quant_mode else 0,
            k_quant_activations=k_quant_mode or "q8_k",
        )
    int_any_rows = (any_rows and requested in ("int8", "int16")) or (q8_k and requested == "int8")
    return TileModes(requested, 0, 0 if int_any_rows else GEMM_FROM_ROWS)
