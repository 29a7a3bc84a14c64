"""A Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2) parameterised by `ModelArch`.

Token layout is flat: every tensor is [T, ...] over the step's tokens of all requests; which
request a token belongs to, and where its K/V live, is in the ForwardContext.
Fused weights: q/k/v are one `qkv_proj` [Hq*D + 2*Hkv*D, hidden] and gate/up one
`gate_up_proj` [2*I, hidden]; `load_weights` fills them from HF's separate tensors.
Under tensor parallelism (model/parallel.py) each rank builds the same modules at its shard's
sizes, loads its slice of every HF tensor, and joins partial results with one all-reduce after
o_proj, one after down_proj and one after the embedding; logits are all-gathered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tokenbus.config import ModelArch
from tokenbus.model.attention import AttentionPlan, Plan, paged_attention
from tokenbus.model.attention_backend import (
    AttentionBackend,
    TorchAttentionBackend,
    select_attention_backend,
)
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.layers import Linear, RMSNorm, RotaryEmbedding, apply_rotary
from tokenbus.model.layers.quantized import (
    DequantBuffer,
    KernelWeight,
    QuantizedLinearKernel,
    QuantizedWeight,
    TileModes,
    is_quantized,
    kernel_weight,
    quantized_embedding,
)
from tokenbus.model.lora import LoRABatch
from tokenbus.model.native import (
    TILE_GEMV_MAX_ROWS,
    FusedOps,
    NativeBuildError,
    PagedAttentionKernel,
    QuantKernels,
    load_fused_ops,
    load_quant_kernels,
)
from tokenbus.model.native.decode_layer import (
    DECODE_LAYER_KV_DTYPES,
    DecodeLayers,
    LayerWeights,
    LinearWeights,
)
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.utils.cpu import CpuFeatures

logger = logging.getLogger(__name__)
WeightLoader = Callable[[str, torch.Tensor], None]
# Checkpoint tensors that carry no information for us (old HF checkpoints store inv_freq).
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        local = tp.shard_arch(arch)
        self.num_heads = local.num_attention_heads
        self.num_kv_heads = local.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            arch.hidden_size, (q_size, kv_size, kv_size), bias=arch.attention_bias
        )
        # HF Llama/Mistral's attention_bias also covers o_proj; Qwen2 has q/k/v biases only.
        o_bias = arch.attention_bias and arch.architecture != "qwen2"
        self.o_proj = Linear(q_size, (arch.hidden_size,), bias=o_bias)
        self.fused: FusedOps | None = None  # fp32 CPU rotary in C (set by the model's finalize)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D], a fresh tensor
        if self.fused is not None:
            self.fused.rope_(
                qkv, cos.view(num_tokens, -1), sin.view(num_tokens, -1), num_qk_heads, self.head_dim
            )
            qkv = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
            q, k = (
                qkv[:, : self.num_heads],
                qkv[:, self.num_heads : num_qk_heads],
            )  # rotated in place
        else:
            qkv = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
            # [T, Hq + Hkv, D], q and k rotated at once
            qk = apply_rotary(qkv[:, :num_qk_heads], cos, sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, num_qk_heads:]  # [T, Hkv, D]
        out = paged_attention(q, k, v, kv_cache, slot_mapping, plan, self.scale)  # [T, Hq, D]
        # Row-parallel: each rank's heads give a partial sum (o_proj's bias lives on rank 0 only).
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {arch.hidden_act!r}")
        self.tp = tp
        size = tp.shard_arch(arch).intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, (size, size))
        self.down_proj = Linear(size, (arch.hidden_size,))
        self.fused: FusedOps | None = None  # fp32 CPU SiLU-and-multiply in C (set by finalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.fused is not None and gate_up.dim() == 2:
            return self.tp.all_reduce(self.down_proj(self.fused.silu_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, 2I] -> 2 x [T, I]
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block. `x` is the previous block's output, not yet added to `residual`."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, slot_mapping, plan)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], ctx) -> final-normed hidden [T, hidden]; compute_logits -> fp32
    logits."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        tp.check_divides(arch)
        self.arch = arch
        self.tp = tp
        self.num_layers = arch.num_hidden_layers
        self.num_kv_heads = tp.shard_arch(arch).num_key_value_heads
        self.head_dim = arch.head_dim
        # This rank's vocabulary rows (all of them without TP).
        self.vocab_start, self.vocab_per_rank = tp.vocab_shard(arch.vocab_size)
        self.embed_tokens = nn.Parameter(
            torch.empty(self.vocab_per_rank, arch.hidden_size), requires_grad=False
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, tp) for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.lm_head = Linear(arch.hidden_size, (self.vocab_per_rank,))
        # Builds the attention metadata the worker hands to forward (ctx.attn_metadata); the
        # torch path until set_attention_backend chooses.
        self.attention_backend: AttentionBackend = TorchAttentionBackend(self.embed_tokens.dtype)
        # A GGUF embedding kept in its blocks (then embed_tokens is released), and its kernels.
        self.embed_quantized: QuantizedWeight | KernelWeight | None = None
        self.quant_kernels: QuantKernels | None = None
        self._tile_modes = TileModes()  # of the tiled GGUF linears: set_quant_activations
        self._decode_layers: DecodeLayers | None = None  # decode_layer.c (set_attention_backend)
        # Which rows of a step use which LoRA adapter (model/lora.py sets it with --enable-lora).
        self.lora_batch: LoRABatch | None = None
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens  # one tensor, two layouts after finalize()

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None
    ) -> torch.Tensor:
        """Run the first `num_layers` decoder layers (default: all), then the final norm.

        With num_layers=N this is the self-speculative draft model; it writes K/V only into
        ctx.kv_caches[:N], and those entries equal the full model's (same weights and inputs).
        """
        num_layers = self.num_layers if num_layers is None else num_layers
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        plan = ctx.attn_metadata
        if plan is None:
            raise ValueError(
                "ForwardContext.attn_metadata is not set: build it with the model's "
                "attention_backend before the forward"
            )
        x = self._embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary.lookup(ctx.positions, x.dtype)
        step = self._native_decode_step(x, cos, sin, ctx, plan)
        residual = None
        connector = ctx.kv_connector
        if step is not None and connector is None:  # every layer in one C call
            residual = torch.empty_like(x)
            self._decode_layers.run_all(num_layers, step, ctx.kv_caches, x, residual)
            return self.norm.add_and_norm(x, residual)[0]
        for layer_idx in range(num_layers):
            if connector is not None:
                connector.wait_for_layer_load(layer_idx)
            if step is not None:  # the whole layer in one C call, x and residual updated in place
                out = residual if residual is not None else torch.empty_like(x)
                self._decode_layers.run(
                    layer_idx, step, ctx.kv_caches[layer_idx], x, residual, x, out
                )
                residual = out
            else:
                x, residual = self.layers[layer_idx](
                    x, residual, cos, sin, ctx.kv_caches[layer_idx], ctx.slot_mapping, plan
                )
            if connector is not None:
                connector.save_kv_layer(layer_idx, ctx.kv_caches[layer_idx])
        return self.norm.add_and_norm(x, residual)[0]

    def _native_decode_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext, plan: Plan
    ):
        """decode_layer.c's step arguments when this step can run layer by layer in C: a
        decode-sized fp32 batch whose attention is all the native kernel's (eager); else None."""
        layers = self._decode_layers
        if (
            layers is None
            or x.shape[0] > TILE_GEMV_MAX_ROWS
            or not isinstance(plan, AttentionPlan)
            or plan.native is None
            or plan.native_long is not None
            or plan.decode_tiles
            or plan.prefills
            or plan.num_tokens != x.shape[0]
        ):
            return None
        kv = ctx.kv_caches[0]
        if kv.dtype not in DECODE_LAYER_KV_DTYPES or not kv.is_contiguous():
            return None
        native = plan.native
        return layers.step_args(
            x.shape[0],
            cos,
            sin,
            ctx.slot_mapping,
            native.block_tables,
            native.query_start,
            native.seq_lens,
            native.reqs,
            kv,
            self._tile_modes.mode(x.shape[0]),
            self.lora_batch.slots if self.lora_batch is not None else None,
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return quantized_embedding(
                self.quant_kernels, self.embed_quantized, input_ids, self.embed_tokens.dtype
            )
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_per_rank)
        x = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.embed_tokens)
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))  # other ranks' ids gave 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (rows of forward's output) -> fp32 logits [N, vocab], on every
        rank."""
        logits = self.lm_head(hidden).float()
        if not self.tp.enabled:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.arch.vocab_size]  # drop the padding rows

    def finalize(self, linear_backend: str = "auto", cpu: CpuFeatures | None = None) -> None:
        """Pack every linear for its device and CPU (see layers/linear.py); "dense" runs plain
        F.linear (benchmarks/decode_step.py --linear-backend compares them)."""
        cpu = cpu or CpuFeatures.detect()
        self._decode_layers = (
            None  # points into the kernels' weights: rebuilt by set_attention_backend
        )
        self._set_fused_ops(cpu)
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        if self.embed_quantized is not None or any(linear.quantized for linear in linears):
            self.quant_kernels = load_quant_kernels(cpu)  # GGUF blocks run on the native kernels
        buffer = DequantBuffer()  # one scratch for all linears: they run one at a time
        for linear in linears:
            linear.finalize(linear_backend, cpu, self.quant_kernels, buffer)
        if self.embed_quantized is not None:  # lookups read the blocks: no dense table
            head = self.lm_head.quantized_weights()
            if self.arch.tie_word_embeddings and len(head) == 1:
                self.embed_quantized = head[0]  # the LM head's (maybe tiled) copy: one in memory
            else:
                self.embed_quantized = kernel_weight(self.quant_kernels, self.embed_quantized)
            self.embed_tokens = nn.Parameter(
                self.embed_tokens.new_empty(0, self.arch.hidden_size), requires_grad=False
            )

    def _set_fused_ops(self, cpu: CpuFeatures) -> None:
        """The norms, rotary and SiLU run fused_ops.c on CPU in fp32 (one C call each instead of
        3-6 ATen ops: native/fused_ops.c), where it builds; torch otherwise."""
        fused = None
        if self.embed_tokens.device.type == "cpu" and self.embed_tokens.dtype == torch.float32:
            try:
                fused = load_fused_ops(cpu)
            except NativeBuildError as exc:
                logger.warning("fused CPU ops unavailable, torch runs them: %s", exc)
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP)):
                module.fused = fused

    def set_quant_activations(self, modes: TileModes) -> None:
        """How the tiled GGUF linears take x (layers/quantized.py): fp32, int16 or int8
        activations, bf16 (AVX512-BF16) from some number of rows up, and an fp32 GEMM on the
        dequantized weight from some number of rows up (TileModes;
        worker/model_builder.quant_activation_modes chooses them)."""
        self._tile_modes = modes
        for module in self.modules():
            if isinstance(module, Linear) and isinstance(module.kernel, QuantizedLinearKernel):
                module.kernel.modes = modes

    def set_attention_backend(
        self, backend: str, decode_layers: bool = True, row_invariant: bool = False
    ) -> None:
        """ "auto" (load_model's default), "torch" or "native": see
        attention.select_attention_kernel.
        A model built without load_model runs the torch path until this is called.
        `decode_layers`: decode-sized steps run each layer in one C call where they can (False:
        op by op, as --enforce-eager asks). `row_invariant`: every query by the native kernel's
        decode path (--batch-invariant: attention_backend.NativeAttentionBackend)."""
        self.attention_backend = select_attention_backend(
            backend, self.embed_tokens.device, self.embed_tokens.dtype, row_invariant
        )
        self._decode_layers = self._build_decode_layers() if decode_layers else None

    def _apply(self, fn, *args, **kwargs):
        # .to(), .float(), share_memory() & co may replace parameters' storage, which the C
        # layers hold raw pointers into: drop them (layer by layer from then on).
        self._decode_layers = None
        return super()._apply(fn, *args, **kwargs)

    def attach_lora(self, batch: LoRABatch) -> None:
        """Adapters are on (worker/lora_slots.py gave every linear its slots): the C layers
        are rebuilt to read the slots too."""
        self.lora_batch = batch
        if self._decode_layers is not None:
            self._decode_layers = self._build_decode_layers()

    @property
    def decodes_in_c(self) -> bool:
        """Whether decode-sized steps run their decoder layers in C (decode_layer.c: all in one
        call, or one call per layer when a KV connector hooks in between)."""
        return self._decode_layers is not None

    def _build_decode_layers(self) -> DecodeLayers | None:
        """decode_layer.c over every layer, where each one can run there: fp32 on CPU with the
        fused ops and the native attention kernel, every linear one tiled GGUF shard, no TP."""
        kernel = self.attention_backend.kernel
        fused = self.layers[0].input_layernorm.fused
        if kernel is None or fused is None or self.quant_kernels is None or self.tp.enabled:
            return None
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [
                _tiled_linear(lin)
                for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if None in linears:
                return None
            layers.append(
                LayerWeights(
                    *linears,
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    layer.input_layernorm.eps,
                    attn.scale,
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                )
            )
        try:
            return DecodeLayers(layers, self.quant_kernels, kernel, fused)
        except NativeBuildError as exc:
            logger.warning("decode layers in C unavailable, torch runs them: %s", exc)
            return None

    @property
    def attention_kernel(self) -> PagedAttentionKernel | None:
        """The native kernel the backend runs; None: the torch path."""
        return self.attention_backend.kernel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (any dtype; cast on copy), strictly, then finalize()."""
        loaders = self._weight_loaders()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in loaded:
                raise ValueError(f"weight {name} appears twice")
            loader = loaders.get(name)
            if loader is None:
                tied_head = name == "lm_head.weight" and self.arch.tie_word_embeddings
                if name.endswith(IGNORED_WEIGHT_SUFFIXES) or tied_head:
                    continue
                raise ValueError(
                    f"unexpected weight {name} for {self.arch.architecture} "
                    f"with {self.num_layers} layers"
                )
            loader(name, tensor)
            loaded.add(name)
        missing = sorted(set(loaders) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (
                f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            )
            raise ValueError(f"missing weights: {shown}")
        self.finalize()

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        """HF tensor name -> function copying that tensor (this rank's slice of it) into our
        (possibly fused) parameter."""
        vocab = _TensorSlicer(self.tp, self.arch).vocab_rows(self.vocab_start, self.vocab_per_rank)
        loaders: dict[str, WeightLoader] = {
            "model.embed_tokens.weight": _sliced(self._load_embedding, vocab),
            "model.norm.weight": partial(_copy_param, self.norm.weight),
        }
        if not self.arch.tie_word_embeddings:
            loaders["lm_head.weight"] = _sliced(self.lm_head.load_shard, vocab)
        for idx, layer in enumerate(self.layers):
            loaders.update(_layer_loaders(f"model.layers.{idx}.", layer, self.tp, self.arch))
        return loaders

    def _load_embedding(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        if not is_quantized(tensor):
            _copy_param(self.embed_tokens, name, tensor)
            return
        if (tensor.rows, tensor.cols) != tuple(self.embed_tokens.shape):
            raise ValueError(
                f"weight {name}: expected shape {list(self.embed_tokens.shape)}, "
                f"got {[tensor.rows, tensor.cols]}"
            )
        self.embed_quantized = tensor
        if self.arch.tie_word_embeddings:  # the LM head reads the same blocks
            self.lm_head.load_shard(name, tensor)


def _tiled_linear(linear: Linear) -> LinearWeights | None:
    """A linear as decode_layer.c runs it (one tiled GGUF shard), or None."""
    kernel = linear.kernel
    if (
        not isinstance(kernel, QuantizedLinearKernel)
        or len(kernel.shards) != 1
        or not kernel.shards[0].tiled
    ):
        return None
    shard = kernel.shards[0]
    return LinearWeights(shard.qtype, shard.data, shard.rows, shard.cols, linear.bias, linear.lora)


def _layer_loaders(
    prefix: str, layer: LlamaDecoderLayer, tp: TensorParallel, arch: ModelArch
) -> dict[str, WeightLoader]:
    attn, mlp = layer.self_attn, layer.mlp
    loaders: dict[str, WeightLoader] = {
        prefix + "input_layernorm.weight": partial(_copy_param, layer.input_layernorm.weight),
        prefix + "post_attention_layernorm.weight": partial(
            _copy_param, layer.post_attention_layernorm.weight
        ),
    }
    cut = _TensorSlicer(tp, arch)
    q_rows = cut.head_rows(attn.num_heads * tp.rank, attn.num_heads)
    kv_rows = cut.head_rows(tp.kv_head_start(arch.num_key_value_heads), attn.num_kv_heads)
    mlp_rows = cut.rows(tp.rank * mlp.down_proj.in_features, mlp.down_proj.in_features)
    # (linear, scope, [(HF name, weight slicer, bias slicer)]) per fused linear.
    fused = [
        (
            attn.qkv_proj,
            "self_attn.",
            [
                ("q_proj", q_rows, q_rows),
                ("k_proj", kv_rows, kv_rows),
                ("v_proj", kv_rows, kv_rows),
            ],
        ),
        (attn.o_proj, "self_attn.", [("o_proj", cut.columns(q_rows), cut.rank0_only())]),
        (mlp.gate_up_proj, "mlp.", [("gate_proj", mlp_rows, None), ("up_proj", mlp_rows, None)]),
        (mlp.down_proj, "mlp.", [("down_proj", cut.columns(mlp_rows), None)]),
    ]
    for linear, scope, shards in fused:
        for shard, (name, weight_slice, bias_slice) in enumerate(shards):
            loaders[f"{prefix}{scope}{name}.weight"] = _sliced(
                partial(linear.load_shard, shard=shard), weight_slice
            )
            if linear.bias is not None:
                loaders[f"{prefix}{scope}{name}.bias"] = _sliced(
                    partial(linear.load_shard, shard=shard, is_bias=True), bias_slice
                )
    return loaders


Slicer = Callable[[torch.Tensor], torch.Tensor]


class _TensorSlicer:
    """This rank's slice of a full HF tensor; None (no slicing) without tensor parallelism."""

    def __init__(self, tp: TensorParallel, arch: ModelArch) -> None:
        self.tp = tp
        self.head_dim = arch.head_dim

    def rows(self, start: int, count: int) -> Slicer | None:
        return None if not self.tp.enabled else (lambda t: t[start : start + count])

    def head_rows(self, first_head: int, num_heads: int) -> Slicer | None:
        return self.rows(first_head * self.head_dim, num_heads * self.head_dim)

    def columns(self, rows: Slicer | None) -> Slicer | None:
        """The same range along the input dim (row-parallel weights are [out, in])."""
        return None if rows is None else (lambda t: rows(t.T).T)

    def rank0_only(self) -> Slicer | None:
        """A row-parallel bias is added once: rank 0 keeps it, the others add zeros."""
        if not self.tp.enabled:
            return None
        return (lambda t: t) if self.tp.rank == 0 else torch.zeros_like

    def vocab_rows(self, start: int, per_rank: int) -> Slicer | None:
        """Rows [start, start + per_rank), zero-padded past the real vocabulary."""
        if not self.tp.enabled:
            return None

        def cut(t: torch.Tensor) -> torch.Tensor:
            part = t[start : start + per_rank]
            pad = per_rank - part.shape[0]
            return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part

        return cut


def _sliced(loader: WeightLoader, slicer: Slicer | None) -> WeightLoader:
    if slicer is None:
        return loader

    def load(name: str, tensor: torch.Tensor) -> None:
        if is_quantized(tensor):
            raise ValueError(
                f"weight {name}: GGUF blocks cannot be split for tensor parallelism; "
                f"use --quantization none"
            )
        loader(name, slicer(tensor))

    return load


def _copy_param(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    if tensor.shape != param.shape:
        raise ValueError(
            f"weight {name}: expected shape {list(param.shape)}, got {list(tensor.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
