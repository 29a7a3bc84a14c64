"""A decoder-only language model built from model/decoder.py's parts (L2): the embedding, the
layers a family file makes (`make_layer`), the final norm and the LM head, and the strict
loading of HF-named weights into them.

Which kernels run it the model does not choose: it holds a KernelPlan (model/kernel_plan.py),
the torch path until `apply_kernels` picks, and hands its layers to `kernels.run_layers`.
Under tensor parallelism (model/parallel.py) each rank holds its vocabulary rows: embedding
lookups outside them give 0 before an all-reduce, and logits are all-gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tokenbus.model.attention_backend import AttentionBackend
from tokenbus.model.decoder import Attention, DecoderLayer
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.kernel_plan import KernelPlan
from tokenbus.model.layers import Linear, RMSNorm, RotaryEmbedding
from tokenbus.model.layers.linear import q8_0_blocks
from tokenbus.model.layers.quantized import (
    KernelWeight,
    QuantizedWeight,
    dense,
    holds_floats,
    is_quantized,
    kernel_weight,
    quantized_embedding,
)
from tokenbus.model.native import PagedAttentionKernel, QuantKernels
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.recurrent import RecurrentPlan
from tokenbus.model.weights import (
    TensorSlicer,
    WeightLoader,
    copy_param,
    layer_loaders,
    load_strictly,
    sliced,
)
from tokenbus.model_arch import ModelArch

# Rows of the stacked cos/sin tables: a model with a local RoPE (ModelArch.rope_local_theta)
# reads GLOBAL_ROPE and LOCAL_ROPE; one with NoPE layers (ModelArch.nope_layers) GLOBAL_ROPE and
# NO_ROPE, the identity turn. No family has both.
GLOBAL_ROPE, LOCAL_ROPE, NO_ROPE = 0, 1, 1


class CausalLM(nn.Module):
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
        self.layers = nn.ModuleList()
        for idx in range(arch.num_hidden_layers):
            self.making_layer = idx  # make_layer's layer, for families whose layers differ
            self.layers.append(self.make_layer(arch, tp))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            arch.global_head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            arch.rotary_dim,
        )
        # Sliding-window layers with a RoPE of their own (rope_local_theta, unscaled: Gemma 3's
        # base): the layers read the two tables stacked, each its row (rotary_lookup).
        self.local_rotary = None
        if arch.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(
                arch.head_dim,
                arch.max_position_embeddings,
                arch.rope_local_theta,
                None,
                arch.rotary_dim,
            )
        if self.local_rotary is not None and arch.nope_layers:
            raise ValueError("a local RoPE and NoPE layers together are not supported")
        for idx, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None)
            if not isinstance(attn, Attention):
                continue
            if arch.sliding_windows:  # Mistral's sliding_window, Qwen2's max_window_layers
                attn.sliding_window = arch.sliding_windows[idx]
            if self.local_rotary is not None:  # every layer then reads a row of the stack
                local = attn.sliding_window is not None
                attn.rope_table = LOCAL_ROPE if local else GLOBAL_ROPE
            if arch.nope_layers:  # likewise: its NoPE layers the identity turn
                attn.rope_table = NO_ROPE if idx in arch.nope_layers else GLOBAL_ROPE
        self.lm_head = Linear(arch.hidden_size, (self.vocab_per_rank,), bias=arch.lm_head_bias)
        # A GGUF embedding kept in its blocks (then embed_tokens is released).
        self.embed_quantized: QuantizedWeight | KernelWeight | None = None
        self.kernels = KernelPlan.portable(self.embed_tokens.dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens  # one tensor, two layouts after the kernels

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        """One decoder layer of this family (a subclass chooses the parts), the
        `making_layer`-th."""
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None
    ) -> torch.Tensor:
        """Run the first `num_layers` decoder layers (default: all), then the final norm.

        With num_layers=N this is the self-speculative draft model; it writes K/V only into
        ctx.kv_caches[:N], and those entries equal the full model's (same weights and inputs).
        """
        num_layers = self.start_step(ctx, num_layers)
        x = self._embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary_lookup(ctx.positions, x.dtype)
        q_scale = self.query_scale(ctx.positions, x.dtype)
        x, residual = self.kernels.run_layers(self.layers, num_layers, x, cos, sin, ctx, q_scale)
        return self.norm.add_and_norm(x, residual)[0]

    def start_step(self, ctx: ForwardContext, num_layers: int | None) -> int:
        """The layers a forward runs (all where None), checked, with the step's plans ready."""
        num_layers = self.num_layers if num_layers is None else num_layers
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        if ctx.attn_metadata is None:
            raise ValueError(
                "ForwardContext.attn_metadata is not set: build it with the model's "
                "attention_backend before the forward"
            )
        if ctx.recurrent_layers:  # one plan for every recurrent layer of the step
            ctx.recurrent_plan = RecurrentPlan.build(ctx, self.arch.conv_kernel)
        return num_layers

    def state_shapes(self) -> dict[int, tuple[int, ...]]:
        """Each recurrent layer's state for one request (worker/state_pool.py sizes its pool
        from it): {} but for recurrent layers (model/recurrent.py)."""
        return {
            idx: layer.mixer.state_shape()
            for idx, layer in enumerate(self.layers)
            if getattr(layer, "mixer", None) is not None
        }

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Llama 4's attention temperature (arch.attn_temperature: Ministral 3's): each token's
        query scale [T, 1, 1], 1 + beta * ln(1 + floor(position / length)), in HF's ops (exactly
        1 before `length`); None for the other families. Tensor ops only: a captured step
        computes it from its positions too."""
        if self.arch.attn_temperature is None:
            return None
        beta, length = self.arch.attn_temperature
        scale = 1 + beta * torch.log(1 + torch.floor(positions / length))
        return scale.to(dtype).view(-1, 1, 1)

    def rotary_lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos, sin [T, 1, D/2] the layers take; with a local RoPE, both tables
        stacked [2, T, 1, D/2] (rows GLOBAL_ROPE, LOCAL_ROPE), each layer reading its row. With
        NoPE layers the second row is the identity turn, cos 1 and sin 0, which gives every
        value back exactly (x * 1 - y * 0 = x): those layers run the shared attention (and
        decode_layer.c's per-layer table) unchanged, bit for bit HF's unturned q and k."""
        cos, sin = self.rotary.lookup(positions, dtype)
        if self.arch.nope_layers:
            return torch.stack((cos, torch.ones_like(cos))), torch.stack(
                (sin, torch.zeros_like(sin))
            )
        if self.local_rotary is None:
            return cos, sin
        local_cos, local_sin = self.local_rotary.lookup(positions, dtype)
        return torch.stack((cos, local_cos)), torch.stack((sin, local_sin))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return quantized_embedding(
                self.kernels.quant, self.embed_quantized, input_ids, self.embed_tokens.dtype
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

    # ------------------------------------------------------------------ the kernel plan's parts
    @property
    def attention_backend(self) -> AttentionBackend:
        """Builds each step's attention metadata (the worker calls it before the forward)."""
        return self.kernels.attention

    @property
    def attention_kernel(self) -> PagedAttentionKernel | None:
        """The native kernel the backend runs; None: the torch path."""
        return self.kernels.attention.kernel

    @property
    def quant_kernels(self) -> QuantKernels | None:
        return self.kernels.quant

    @property
    def decodes_in_c(self) -> bool:
        """Whether decode-sized steps run their decoder layers in C (decode_layer.c: all in one
        call, or one call per layer when a KV connector hooks in between)."""
        return self.kernels.decode_layers is not None

    def _apply(self, fn, *args, **kwargs):
        # .to(), .float(), share_memory() & co may replace parameters' storage, which the C
        # layers hold raw pointers into: drop them (layer by layer from then on).
        self.kernels = self.kernels.without_decode_layers()
        return super()._apply(fn, *args, **kwargs)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (any dtype; cast on copy), strictly. The kernels that run
        them are chosen after (kernel_plan.apply_kernels)."""
        load_strictly(self._weight_loaders(), weights, self.arch)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        """HF tensor name -> function copying that tensor (this rank's slice of it) into our
        (possibly fused) parameter."""
        vocab = TensorSlicer(self.tp, self.arch).vocab_rows(self.vocab_start, self.vocab_per_rank)
        loaders: dict[str, WeightLoader] = {
            "model.embed_tokens.weight": sliced(self._load_embedding, vocab),
            "model.norm.weight": partial(copy_param, self.norm.weight),
        }
        if getattr(self.norm, "bias", None) is not None:  # a LayerNorm's (PhiMoE's)
            loaders["model.norm.bias"] = partial(copy_param, self.norm.bias)
        if not self.arch.tie_word_embeddings:
            loaders["lm_head.weight"] = sliced(self.lm_head.load_shard, vocab)
        if self.lm_head.bias is not None:  # this rank's vocabulary rows, as the weight's
            head_bias = partial(self.lm_head.load_shard, is_bias=True)
            loaders["lm_head.bias"] = sliced(head_bias, vocab)
        for idx, layer in enumerate(self.layers):
            loaders.update(layer_loaders(f"model.layers.{idx}.", layer, self.tp, self.arch))
            if getattr(layer, "mixer", None) is not None:  # a recurrent layer's mixer
                scope = f"model.layers.{idx}.{layer.mixer.hf_scope}"
                loaders.update(layer.mixer.weight_loaders(scope, self.arch))
        return loaders

    def quantized_tables(self) -> list[QuantizedWeight | KernelWeight]:
        """The lookup tables kept in GGUF blocks (the embedding's; a family's own too)."""
        return [] if self.embed_quantized is None else [self.embed_quantized]

    def finalize_tables(self, quant: QuantKernels | None) -> None:
        """Put the tables kept in GGUF blocks in the kernels' layout, once the linears are
        (kernel_plan.apply_kernels): lookups then read the blocks, no dense table is kept."""
        if self.embed_quantized is None:
            return
        head = self.lm_head.quantized_weights()
        if self.arch.tie_word_embeddings and len(head) == 1:
            self.embed_quantized = head[0]  # the LM head's (maybe tiled) copy: one in memory
        else:
            self.embed_quantized = kernel_weight(quant, self.embed_quantized)
        self.embed_tokens = nn.Parameter(
            self.embed_tokens.new_empty(0, self.arch.hidden_size), requires_grad=False
        )

    def _load_embedding(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        if self.lm_head.round_to_q8_0 and holds_floats(tensor):
            # --quantization q8_0: the embedding too, as a Q8_0 GGUF's (one copy when tied)
            tensor = q8_0_blocks(dense(tensor))
        if not is_quantized(tensor):
            copy_param(self.embed_tokens, name, tensor)
            return
        if (tensor.rows, tensor.cols) != tuple(self.embed_tokens.shape):
            raise ValueError(
                f"weight {name}: expected shape {list(self.embed_tokens.shape)}, "
                f"got {[tensor.rows, tensor.cols]}"
            )
        self.embed_quantized = tensor
        if self.arch.tie_word_embeddings:  # the LM head reads the same blocks
            self.lm_head.load_shard(name, tensor)
