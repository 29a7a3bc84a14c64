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

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenbus.model.decoder import DecoderLayer
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.layers import RMSNorm
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
