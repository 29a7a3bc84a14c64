"""LFM2's gated short convolution (L2): a recurrent layer beside attention layers.

    B, C, u = in_proj(x)             (three [T, H] views)
    y = out_proj(C * conv(B * u))    conv: depthwise and causal, K taps over a channel's inputs

Tap k of token t's window multiplies the input K - 1 - k steps before it (HF's Conv1d with
K - 1 zeros of padding, cut to the sequence's length). A request's window reaches back across
chunk and step boundaries, so each request holds its last K - 1 inputs between steps: its row
of the layer's state pool [num_rows, K - 1, H] (worker/state_pool.py allocates the pools, one
per conv layer, and gives each running request a row, zeroed when it starts from its first
token). That state is the whole of what the layer remembers: it has no K/V, no block table and
no prefix-cache hits (engine/setup.py turns prefix caching off for these models).

Indexing (ConvPlan, built once per step and shared by every conv layer): the step's inputs
`seq` are every request's K - 1 state entries, request after request, then the step's T tokens
(B * u). In request r's segment — its K - 1 state entries followed by its q_r tokens — token i
stands at K - 1 + i, and its window is the segment's entries i .. i + K - 1; the request's new
state is the segment's last K - 1 entries (partly old state when q_r < K - 1). `window_src` and
`state_src` map those segment entries to rows of `seq`, for any mix of decodes and chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from tokenbus.model.attention import Plan
from tokenbus.model.decoder import GatedMLP
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.layers import Linear, RMSNorm
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import (
    TensorSlicer,
    WeightLoader,
    copy_param,
    fused_rows_loader,
    sliced,
)
from tokenbus.model_arch import ModelArch


@dataclass(frozen=True)
class ConvPlan:
    """One step's indices for every short-convolution layer (see the module docstring)."""

    rows: torch.Tensor  # [R] int64: each request's row of the state pools
    window_src: torch.Tensor  # [T, K] int64: rows of `seq` in each token's window, oldest first
    state_src: torch.Tensor  # [R, K - 1] int64: rows of `seq` that are each request's new state

    @classmethod
    def build(cls, ctx: ForwardContext, kernel: int) -> ConvPlan:
        """From the step's request boundaries and state rows (ctx.state_rows)."""
        if ctx.state_rows is None:
            raise ValueError("a short-convolution layer needs ForwardContext.state_rows")
        held = kernel - 1
        starts = np.asarray(ctx.query_start_loc, dtype=np.int64)
        num_reqs, lens = len(starts) - 1, np.diff(starts)
        request = np.repeat(np.arange(num_reqs), lens)  # [T] each token's request

        def seq_rows(req: np.ndarray, entry: np.ndarray) -> np.ndarray:
            """Rows of `seq` of entries `entry` of requests `req`' segments: a state entry
            (entry < K - 1) is row req * (K - 1) + entry, token i = entry - (K - 1) follows the
            R * (K - 1) state rows at its place in the step."""
            token = num_reqs * held + starts[req] + entry - held
            return np.where(entry < held, req * held + entry, token)

        local = np.arange(len(request)) - starts[request]  # each token's index in its chunk
        window = seq_rows(request[:, None], local[:, None] + np.arange(kernel))
        state = seq_rows(np.arange(num_reqs)[:, None], lens[:, None] + np.arange(held))
        device = ctx.state_rows.device
        return cls(
            ctx.state_rows[:num_reqs],
            torch.from_numpy(window).to(device),
            torch.from_numpy(state).to(device),
        )


class ShortConv(nn.Module):
    """in_proj -> B * u -> causal depthwise conv (with the request's state) -> C * . ->
    out_proj. Under tensor parallelism each rank holds H / size channels of B, C, u, the
    conv and out_proj's columns; out_proj's partial sums are all-reduced."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if arch.hidden_size % tp.size:
            raise ValueError(
                f"hidden_size {arch.hidden_size} is not divisible by tensor_parallel_size "
                f"{tp.size} (a short convolution's channels are split)"
            )
        self.tp = tp
        self.kernel = arch.conv_kernel
        self.channels = arch.hidden_size // tp.size
        channels, bias = self.channels, arch.conv_bias
        self.in_proj = Linear(arch.hidden_size, (channels, channels, channels), bias=bias)
        self.out_proj = Linear(channels, (arch.hidden_size,), bias=bias)
        # [H, K]: HF's Conv1d weight [H, 1, K] without its group dim, as llama.cpp stores it
        self.weight = nn.Parameter(torch.empty(channels, self.kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    def state_shape(self) -> tuple[int, int]:
        """One request's state: its last K - 1 inputs to the conv, [K - 1, H / size]."""
        return (self.kernel - 1, self.channels)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: torch.Tensor,
        rows: torch.Tensor,
        plan: ConvPlan,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An attention layer's arguments (decoder layers call their mixer alike): `state` is
        this layer's pool [num_rows, K - 1, H], `rows` the step's rows of it (plan.rows);
        the rotary tables and q_scale are unused."""
        b, c, u = self.in_proj(x).split(self.channels, dim=-1)  # [T, H] each
        held = state[rows]  # [R, K - 1, H]
        seq = torch.cat((held.reshape(-1, self.channels), b * u))  # [R (K - 1) + T, H]
        conv = (seq[plan.window_src] * self.weight.t()).sum(dim=1)  # [T, H]
        if self.bias is not None:
            conv = conv + self.bias
        state[rows] = seq[plan.state_src].to(state.dtype)
        return self.tp.all_reduce(self.out_proj(c * conv))

    def weight_loaders(self, prefix: str, arch: ModelArch) -> dict[str, WeightLoader]:
        """HF names under `prefix` ("model.layers.N.conv."): in_proj [3H, H] cut into B, C, u
        (this rank's channels of each), the conv [H, 1, K] or [H, K] (GGUF's), out_proj [H, H]
        by its columns (a bias on rank 0)."""
        cut = TensorSlicer(self.tp, arch)
        channels = cut.rows(self.tp.rank * self.channels, self.channels)
        hidden = arch.hidden_size
        loaders: dict[str, WeightLoader] = {}
        for kind in ("weight", "bias") if self.bias is not None else ("weight",):
            load = partial(self.in_proj.load_shard, is_bias=kind == "bias")
            parts = [sliced(partial(load, shard=shard), channels) for shard in range(3)]
            loaders[f"{prefix}in_proj.{kind}"] = fused_rows_loader(parts, (hidden,) * 3)
        loaders[f"{prefix}out_proj.weight"] = sliced(
            self.out_proj.load_shard, cut.columns(channels)
        )
        loaders[f"{prefix}conv.weight"] = sliced(self._load_conv, channels)
        if self.bias is not None:
            loaders[f"{prefix}out_proj.bias"] = sliced(
                partial(self.out_proj.load_shard, is_bias=True), cut.rank0_only()
            )
            loaders[f"{prefix}conv.bias"] = sliced(partial(copy_param, self.bias), channels)
        return loaders

    def _load_conv(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dim() == 3 and tensor.shape[1] == 1:  # HF's Conv1d [H, 1, K]
            tensor = tensor[:, 0]
        copy_param(self.weight, name, tensor)


class ConvDecoderLayer(nn.Module):
    """decoder.DecoderLayer's pre-norm block with a short convolution where attention was:
    x + conv(norm(x)), then + mlp(norm(.)), the residual carried apart."""

    def __init__(
        self, arch: ModelArch, conv: ShortConv, mlp: GatedMLP, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.conv = conv
        self.post_attention_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: torch.Tensor,
        rows: torch.Tensor,
        plan: Plan | ConvPlan,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.conv(h, cos, sin, state, rows, plan, q_scale)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual
