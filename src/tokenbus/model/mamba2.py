"""Mamba2's selective state-space mixer (L2), a recurrent layer (model/recurrent.py): Granite
4.0-H's.

    z, xBC, dt = in_proj(x)                       gate [I], xBC [I + 2GN], one dt per head
    x, B, C = silu(conv(xBC))                     the causal conv with the request's held inputs
    per head h (P channels, state [P, N]), token t:
        S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T      (dt_t = softplus(dt + dt_bias))
        y_t = S_t C_t + D_h x_t
    out_proj(rms_norm(y * silu(z)) per group)

B and C come in G groups, each shared by H / G consecutive heads. A request's state is its conv's
last K - 1 inputs and its S for every head, one flat row of the layer's pool.

A decode step's S is one update per request, all decodes at once, in place in the pool (the
layer's ops: fused_ops.c's ssm_decode_step on CPU in fp32). A chunk runs the scan in the
state-space-dual form, in pieces of mamba_chunk tokens (as HF's torch path): within a piece,
token t takes token u's input (u <= t) decayed by exp(a_{u+1} + ... + a_t) (a = dt A, the cumsum
below), plus the piece's starting state decayed to t; the piece's end state carries to the next.
The scan runs in fp32 (HF's too), and the pool keeps the state in fp32 in any model
(fp32_state: worker/state_pool.py), A too.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from tokenbus.model.layers import Linear
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.recurrent import DecayingStateMixer, RecurrentPlan, causal_conv, frozen_param
from tokenbus.model.weights import WeightLoader, copy_param, fused_rows_loader
from tokenbus.model_arch import ModelArch


class Mamba2Mixer(DecayingStateMixer):
    hf_scope = "mamba."  # its weights' names in a decoder layer (model.layers.N.mamba.*)

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if tp.enabled:
            raise ValueError("Mamba2 layers do not run under tensor parallelism yet")
        self.heads, self.head_dim = arch.mamba_heads, arch.mamba_head_dim
        self.state_size, self.groups = arch.mamba_state, arch.mamba_groups
        self.chunk = arch.mamba_chunk
        self.dt_limit, self.eps = arch.mamba_dt_limit, arch.rms_norm_eps
        if self.heads % self.groups:
            raise ValueError(f"mamba_n_groups {self.groups} must divide mamba_n_heads {self.heads}")
        self.inner = self.heads * self.head_dim  # I
        conv_dim = self.inner + 2 * self.groups * self.state_size
        # S [H, P, N] per request
        s_shape = (self.heads, self.head_dim, self.state_size)
        self.make_state(arch.conv_kernel, conv_dim, s_shape, self.heads)
        bias = arch.mamba_proj_bias
        self.in_proj = Linear(arch.hidden_size, (self.inner, self.conv_dim, self.heads), bias=bias)
        self.out_proj = Linear(self.inner, (arch.hidden_size,), bias=bias)
        self.conv_bias = frozen_param(self.conv_dim) if arch.conv_bias else None
        self.D = frozen_param(self.heads)
        self.norm_weight = frozen_param(self.inner)

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
        layer's pool [num_rows, state_shape] (the step's `rows` of it: plan.rows); the rotary
        tables and q_scale are unused."""
        held, ssm = self.state_views(state)
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = F.silu(causal_conv(xbc, held, plan, self.conv_weight, self.conv_bias))
        size = self.groups * self.state_size
        inputs, b, c = xbc.split([self.inner, size, size], dim=-1)
        y = self._scan(inputs, b, c, dt, ssm, plan)  # [T, I] fp32
        return self.out_proj(self._gated_norm(y, gate).to(x.dtype))

    def _scan(
        self,
        inputs: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        dt: torch.Tensor,
        ssm: torch.Tensor,
        plan: RecurrentPlan,
    ) -> torch.Tensor:
        """y [T, I] (fp32, D's skip included) of the step's tokens; each request's S in `ssm`
        [num_rows, H, P, N] advanced past them."""
        tokens = inputs.shape[0]
        x = inputs.float().view(tokens, self.heads, self.head_dim)
        dt = F.softplus((dt + self.dt_bias).float()).clamp(*self.dt_limit)  # [T, H]
        b = b.float().view(tokens, self.groups, self.state_size)  # views of the conv's output
        c = c.float().view(tokens, self.groups, self.state_size)
        a, d = self.A.float(), self.D.float()
        decodes = plan.num_decodes  # the first requests, one token each (their rows: tokens)
        if decodes == len(plan.query_start_loc) - 1:  # all decodes: each S read and written once
            y = self.ops.ssm_decode_step_(ssm, plan.rows, x, dt, a, b, c, d)
            return y.view(tokens, self.inner)
        y = torch.empty_like(x)
        if decodes:
            mine = slice(0, decodes)
            y[mine] = self.ops.ssm_decode_step_(
                ssm, plan.rows[mine], x[mine], dt[mine], a, b[mine], c[mine], d
            )
        starts = plan.query_start_loc
        for r in range(decodes, len(starts) - 1):
            piece = slice(starts[r], starts[r + 1])
            row = plan.rows[r]
            y[piece], s = self._chunked(
                x[piece], dt[piece], a, b[piece], c[piece], ssm[row].float()
            )
            y[piece] += d[:, None] * x[piece]
            ssm[row] = s.to(ssm.dtype)
        return y.view(tokens, self.inner)

    def _heads(self, groups: torch.Tensor) -> torch.Tensor:
        """[..., G, N] -> [..., H, N]: each group's B or C for each of its heads."""
        return groups.repeat_interleave(self.heads // self.groups, dim=-2)

    def _chunked(self, x, dt, a, b, c, s):
        """One request's tokens: x [L, H, P], dt [L, H], b/c [L, G, N], s [H, P, N] (its state
        before them) -> (y [L, H, P], s after them)."""
        out = []
        per_group = self.heads // self.groups
        for start in range(0, x.shape[0], self.chunk):
            piece = slice(start, start + self.chunk)
            xs, dts, bs, cs = x[piece], dt[piece], b[piece], c[piece]
            n = xs.shape[0]
            # log of each token's decay since the piece's start, per head: a_0 + ... + a_t
            cum = torch.cumsum(dts * a, dim=0)  # [n, H]
            gaps = (cum[:, None, :] - cum[None, :, :]).permute(2, 0, 1)  # [H, t, u]
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            decays = torch.exp(gaps.masked_fill(~causal, float("-inf")))  # 0 where u > t
            scores = torch.einsum("tgk,ugk->gtu", cs, bs)  # C_t . B_u, per group
            weights = scores.repeat_interleave(per_group, dim=0) * decays  # [H, t, u]
            y = torch.einsum("htu,uhp->thp", weights, xs * dts[..., None])
            y = y + torch.einsum("thk,hpk->thp", self._heads(cs), s) * torch.exp(cum)[..., None]
            to_end = torch.exp(cum[-1] - cum) * dts  # [n, H]: each input's weight at the end
            s = s * torch.exp(cum[-1])[:, None, None] + torch.einsum(
                "uhp,uhk->hpk", xs * to_end[..., None], self._heads(bs)
            )
            out.append(y)
        return torch.cat(out), s

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(gate) over each group's I / G channels, in fp32, times the
        weight (HF's RMSNormGated, norm after the gate)."""
        h = y * F.silu(gate.float())
        grouped = h.view(h.shape[0], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * grouped.view_as(h).to(self.norm_weight.dtype)

    def weight_loaders(self, prefix: str, arch: ModelArch) -> dict[str, WeightLoader]:
        """HF names under `prefix` ("model.layers.N.mamba."): in_proj [I + conv_dim + H,
        hidden] cut into gate, xBC and dt; conv1d [conv_dim, 1, K] (or GGUF's [conv_dim, K]);
        A_log (kept as A = -exp(A_log)); dt_bias, D, the norm's weight and out_proj."""
        sizes = (self.inner, self.conv_dim, self.heads)
        loaders: dict[str, WeightLoader] = {
            **self.state_loaders(prefix),
            f"{prefix}D": partial(copy_param, self.D),
            f"{prefix}norm.weight": partial(copy_param, self.norm_weight),
            f"{prefix}out_proj.weight": self.out_proj.load_shard,
        }
        kinds = ("weight", "bias") if self.in_proj.bias is not None else ("weight",)
        for kind in kinds:
            load = partial(self.in_proj.load_shard, is_bias=kind == "bias")
            parts = [partial(load, shard=shard) for shard in range(3)]
            loaders[f"{prefix}in_proj.{kind}"] = fused_rows_loader(parts, sizes)
        if self.out_proj.bias is not None:
            loaders[f"{prefix}out_proj.bias"] = partial(self.out_proj.load_shard, is_bias=True)
        if self.conv_bias is not None:
            loaders[f"{prefix}conv1d.bias"] = partial(copy_param, self.conv_bias)
        return loaders
