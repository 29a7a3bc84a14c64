"""LFM2's gated short convolution (L2), a recurrent layer (model/recurrent.py) beside attention
layers:

    B, C, u = in_proj(x)             (three [T, H] views)
    y = out_proj(C * conv(B * u))    conv: depthwise and causal, K taps over a channel's inputs

Its state is each request's last K - 1 inputs to the conv, [K - 1, H] in its pool row.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tokenbus.model.layers import Linear
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.recurrent import RecurrentPlan, causal_conv, frozen_param, load_conv_weight
from tokenbus.model.weights import (
    TensorSlicer,
    WeightLoader,
    copy_param,
    fused_rows_loader,
    sliced,
)
from tokenbus.model_arch import ModelArch


class ShortConv(nn.Module):
    """in_proj -> B * u -> causal depthwise conv (with the request's held inputs) -> C * . ->
    out_proj. Under tensor parallelism each rank holds H / size channels of B, C, u, the
    conv and out_proj's columns; out_proj's partial sums are all-reduced."""

    hf_scope = "conv."  # its weights' names in a decoder layer (model.layers.N.conv.*)

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
        self.weight = frozen_param(channels, self.kernel)
        self.bias = frozen_param(channels) if bias else None

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
        plan: RecurrentPlan,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An attention layer's arguments (recurrent.RecurrentDecoderLayer): `state` is this
        layer's pool [num_rows, K - 1, H] (the step's `rows` of it: plan.rows); the rotary
        tables and q_scale are unused."""
        b, c, u = self.in_proj(x).split(self.channels, dim=-1)  # [T, H] each
        conv = causal_conv(b * u, state, plan, self.weight, self.bias)
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
        loaders[f"{prefix}conv.weight"] = sliced(partial(load_conv_weight, self.weight), channels)
        if self.bias is not None:
            loaders[f"{prefix}out_proj.bias"] = sliced(
                partial(self.out_proj.load_shard, is_bias=True), cut.rank0_only()
            )
            loaders[f"{prefix}conv.bias"] = sliced(partial(copy_param, self.bias), channels)
        return loaders
