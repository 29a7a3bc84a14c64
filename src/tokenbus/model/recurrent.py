"""What recurrent layers share (L2). Such a layer keeps a state per request instead of K/V: LFM2's
gated short convolutions (model/short_conv.py), Mamba2's selective state spaces
(model/mamba2.py) and Qwen3.5's Gated DeltaNet (model/gated_delta_net.py). This module holds the
step's plan over their state rows, the causal depthwise convolution all run over their state,
and the pre-norm block around them.

A request's state lives in one row of its layer's pool (worker/state_pool.py allocates the
pools, one per recurrent layer, and gives each running request a row, zeroed when it starts from
its first token). That state is all the layer remembers: it has no K/V, no block table and no
prefix-cache hits (engine/setup.py turns prefix caching off for these models).

The convolution is causal: tap k of token t's window multiplies the input K - 1 - k steps
before it (HF's Conv1d with K - 1 zeros of padding, cut to the sequence's length). A window
reaches back across chunk and step boundaries, so each request holds its last K - 1 inputs.

Indexing (RecurrentPlan, built once per step and shared by every recurrent layer): the step's
inputs `seq` are every request's K - 1 held inputs, request after request, then the step's T
tokens. In request r's segment (its K - 1 held inputs followed by its q_r tokens) token i
stands at K - 1 + i, and its window is the segment's entries i .. i + K - 1. The request's new
held inputs are the segment's last K - 1 entries (partly old ones when q_r < K - 1).
`window_src` and `state_src` map those segment entries to rows of `seq`, for any mix of decodes
and chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from tokenbus.model.decoder import DecoderLayer, SandwichDecoderLayer
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.layers import OpsModule, RMSNorm
from tokenbus.model.weights import WeightLoader, copy_param
from tokenbus.model_arch import ModelArch


@dataclass(frozen=True)
class RecurrentPlan:
    """One step's indices for every recurrent layer (see the module docstring)."""

    rows: torch.Tensor  # [R] int64: each request's row of the state pools
    token_rows: torch.Tensor  # [T] int64: each token's request's row
    window_src: torch.Tensor  # [T, K] int64: rows of `seq` in each token's window, oldest first
    state_src: torch.Tensor  # [R, K - 1] int64: rows of `seq` that are each request's new state
    query_start_loc: tuple[int, ...]  # [R + 1], host ints: request r's tokens, as the step's
    num_decodes: int  # the leading requests of one token each (the batch puts decodes first)

    @classmethod
    def build(cls, ctx: ForwardContext, kernel: int) -> RecurrentPlan:
        """From the step's request boundaries and state rows (ctx.state_rows); `kernel` is the
        convolution's K."""
        if ctx.state_rows is None:
            raise ValueError("a recurrent layer needs ForwardContext.state_rows")
        held = kernel - 1
        starts = np.asarray(ctx.query_start_loc, dtype=np.int64)
        num_reqs, lens = len(starts) - 1, np.diff(starts)
        request = np.repeat(np.arange(num_reqs), lens)  # [T] each token's request

        def seq_rows(req: np.ndarray, entry: np.ndarray) -> np.ndarray:
            """Rows of `seq` of entries `entry` of requests `req`' segments: a held input
            (entry < K - 1) is row req * (K - 1) + entry, token i = entry - (K - 1) follows the
            R * (K - 1) held rows at its place in the step."""
            token = num_reqs * held + starts[req] + entry - held
            return np.where(entry < held, req * held + entry, token)

        local = np.arange(len(request)) - starts[request]  # each token's index in its chunk
        window = seq_rows(request[:, None], local[:, None] + np.arange(kernel))
        state = seq_rows(np.arange(num_reqs)[:, None], lens[:, None] + np.arange(held))
        device = ctx.state_rows.device
        longer = np.flatnonzero(lens != 1)
        rows = ctx.state_rows[:num_reqs]
        return cls(
            rows,
            rows[torch.from_numpy(request).to(device)],
            torch.from_numpy(window).to(device),
            torch.from_numpy(state).to(device),
            tuple(int(s) for s in starts),
            int(longer[0]) if len(longer) else num_reqs,
        )


def causal_conv(
    x: torch.Tensor,
    held: torch.Tensor,
    plan: RecurrentPlan,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The depthwise causal convolution of the step's inputs x [T, C] (weight [C, K], bias
    [C] or None), each request's window starting with its held inputs: `held` [num_rows, K - 1,
    C], the layer's pool of them, whose rows of the step's requests are updated in place."""
    channels = x.shape[-1]
    seq = torch.cat((held[plan.rows].reshape(-1, channels), x))  # [R (K - 1) + T, C]
    out = (seq[plan.window_src] * weight.t()).sum(dim=1)  # [T, C]
    held[plan.rows] = seq[plan.state_src].to(held.dtype)
    return out if bias is None else out + bias


def frozen_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An empty inference-only parameter (its loader fills it)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def load_conv_weight(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """A depthwise Conv1d's weight: HF's [C, 1, K], or GGUF's [C, K], into `param` [C, K]."""
    if tensor.dim() == 3 and tensor.shape[1] == 1:
        tensor = tensor[:, 0]
    copy_param(param, name, tensor)


class DecayingStateMixer(OpsModule):
    """What Mamba2 (model/mamba2.py) and Gated DeltaNet (model/gated_delta_net.py) share. A
    request's state row holds its causal conv's K - 1 held inputs [K - 1, conv_dim], then a state
    S of `s_shape` that decays by each head's rate A = -exp(A_log) and a softplus of dt + a
    bias. The pool keeps the row in fp32 in any model (fp32_state: worker/state_pool.py), and A
    is fp32 too: HF keeps S in fp32 and takes -exp(A_log) in fp32 each step."""

    fp32_state = True

    def make_state(self, kernel: int, conv_dim: int, s_shape: tuple[int, ...], heads: int) -> None:
        """The conv's taps [conv_dim, kernel], dt's bias and A [heads]; the row's layout."""
        self.kernel, self.conv_dim, self.s_shape = kernel, conv_dim, s_shape
        self.conv_weight = frozen_param(conv_dim, kernel)
        self.dt_bias = frozen_param(heads)
        self.A = frozen_param(heads, dtype=torch.float32)

    def state_shape(self) -> tuple[int]:
        """One request's state, flat: the conv's held inputs, then S."""
        return ((self.kernel - 1) * self.conv_dim + math.prod(self.s_shape),)

    def state_views(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool [num_rows, state_shape] as (held inputs [num_rows, K - 1, conv_dim], S
        [num_rows, *s_shape]): views, updated in place."""
        held_size = (self.kernel - 1) * self.conv_dim
        held = state[:, :held_size].view(-1, self.kernel - 1, self.conv_dim)
        return held, state[:, held_size:].view(-1, *self.s_shape)

    def state_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """HF names under `prefix` of the conv's weight ([conv_dim, 1, K], or a GGUF's
        [conv_dim, K]), dt_bias, and A_log (kept as A = -exp(A_log))."""
        return {
            f"{prefix}conv1d.weight": partial(load_conv_weight, self.conv_weight),
            f"{prefix}dt_bias": partial(copy_param, self.dt_bias),
            f"{prefix}A_log": self._load_a_log,
        }

    def _load_a_log(self, name: str, tensor: torch.Tensor) -> None:
        copy_param(self.A, name, -torch.exp(tensor.float()))

    def _apply(self, fn, *args, **kwargs):
        # .to(bfloat16) & co convert every parameter: A goes back to fp32
        result = super()._apply(fn, *args, **kwargs)
        self.A.data = self.A.data.float()
        return result


class RecurrentDecoderLayer(DecoderLayer):
    """DecoderLayer's pre-norm block with a recurrent mixer where attention was (no
    self_attn): x + mixer(norm(x)), then + mlp(norm(.)), Granite's residual scale on both. The
    mixer takes an attention layer's arguments: its state pool where the K/V cache was, the
    step's state rows where the slots were, the recurrent plan where the attention plan was."""

    def __init__(
        self, arch: ModelArch, mixer: nn.Module, mlp: nn.Module, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__(arch, None, mlp, norm)
        self.mixer = mixer

    def mix(self, h: torch.Tensor, *step) -> torch.Tensor:
        return self.mixer(h, *step)


class RecurrentSandwichDecoderLayer(SandwichDecoderLayer):
    """SandwichDecoderLayer's block with a recurrent mixer where attention was (LFM3's
    convolution layers): x + post_norm(mixer(norm(x))), then + post_norm(mlp(norm(.))), the
    mixer taking RecurrentDecoderLayer's arguments."""

    def __init__(
        self, arch: ModelArch, mixer: nn.Module, mlp: nn.Module, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__(arch, None, mlp, norm)
        self.mixer = mixer

    mix = RecurrentDecoderLayer.mix
