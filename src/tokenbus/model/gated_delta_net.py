"""Gated DeltaNet (L2), a recurrent layer (model/recurrent.py): Qwen3.5's linear attention.

    qkv, z, b, a = in_proj(x)                    qkv [2 Hk dk + Hv dv], z [Hv dv], b, a [Hv]
    q, k, v = silu(conv(qkv))                    the causal conv with the request's held inputs
    q, k = l2norm(q) / sqrt(dk), l2norm(k)       per key head
    beta = sigmoid(b), g = A softplus(a + dt_bias)         A = -exp(A_log): g <= 0, a log decay
    per value head h (its key head: grouped, j // (Hv / Hk), or tiled, j % Hk), token t:
        S = exp(g_t) S                                      S [dk, dv]
        S = S + k_t (beta_t (v_t - S^T k_t))^T             the delta rule: v_t overwrites what
        o_t = S^T q_t                                       S recalled for k_t, by beta_t
    out_proj(rms_norm(o) w * silu(z))             the norm over each head's dv channels

A request's state is its conv's last K - 1 inputs and its S for every value head, one flat row
of the layer's pool. The recurrence runs the step's tokens in order (layer ops: fused_ops.c's
gated_delta_rule on CPU in fp32, one call for decodes and chunks alike; torch elsewhere, the
decodes batched and each chunk in the chunked form: layers/delta_rule.py), in fp32; the pool
keeps the state in fp32 in any model (fp32_state: worker/state_pool.py), A too.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from tokenbus.model.layers import Linear
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.recurrent import DecayingStateMixer, RecurrentPlan, causal_conv, frozen_param
from tokenbus.model.weights import WeightLoader, copy_param
from tokenbus.model_arch import ModelArch

L2_EPS = 1e-6  # HF's l2norm (FLA's)


class GatedDeltaNet(DecayingStateMixer):
    hf_scope = "linear_attn."  # its weights' names in a decoder layer

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if tp.enabled:
            raise ValueError("Gated DeltaNet layers do not run under tensor parallelism yet")
        self.k_heads, self.v_heads = arch.delta_k_heads, arch.delta_v_heads
        self.k_dim, self.v_dim = arch.delta_k_dim, arch.delta_v_dim
        if self.v_heads % self.k_heads:
            raise ValueError(
                f"linear_num_key_heads {self.k_heads} must divide "
                f"linear_num_value_heads {self.v_heads}"
            )
        self.tiled, self.eps = arch.delta_v_tiled, arch.rms_norm_eps
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        conv_dim = 2 * self.key_size + self.value_size
        s_shape = (self.v_heads, self.k_dim, self.v_dim)  # S per request
        self.make_state(arch.conv_kernel, conv_dim, s_shape, self.v_heads)
        self.sizes = (self.conv_dim, self.value_size, self.v_heads, self.v_heads)  # qkv, z, b, a
        self.in_proj = Linear(arch.hidden_size, self.sizes)
        self.out_proj = Linear(self.value_size, (arch.hidden_size,))
        self.norm_weight = frozen_param(self.v_dim)

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
        tokens = x.shape[0]
        held, s = self.state_views(state)
        qkv, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        qkv = F.silu(causal_conv(qkv, held, plan, self.conv_weight, None)).float()
        q, k, v = qkv.split((self.key_size, self.key_size, self.value_size), dim=-1)
        q = _l2norm(q.reshape(tokens, self.k_heads, self.k_dim)) * self.k_dim**-0.5
        k = _l2norm(k.reshape(tokens, self.k_heads, self.k_dim))
        v = v.reshape(tokens, self.v_heads, self.v_dim)
        beta = torch.sigmoid(b.float())
        g = self.A.float() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
        o = self.ops.gated_delta_rule_(s, plan.token_rows, q, k, v, g, beta, self.tiled)
        return self.out_proj(self._gated_norm(o, z).to(x.dtype))

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of o [T, Hv, dv] over each head's channels, in fp32, times the weight, times
        silu(z) (HF's RMSNormGated: the norm before the gate) -> [T, Hv dv]."""
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = self.norm_weight.float() * o
        return (o * F.silu(z.float().view_as(o))).view(o.shape[0], -1)

    def weight_loaders(self, prefix: str, arch: ModelArch) -> dict[str, WeightLoader]:
        """HF names under `prefix` ("model.layers.N.linear_attn."): in_proj_qkv, in_proj_z,
        in_proj_b and in_proj_a as the fused in_proj's shards; conv1d [conv_dim, 1, K] (or a
        GGUF's [conv_dim, K]); A_log (kept as A = -exp(A_log)); dt_bias, the norm's weight and
        out_proj."""
        loaders: dict[str, WeightLoader] = {
            f"{prefix}in_proj_{part}.weight": partial(self.in_proj.load_shard, shard=shard)
            for shard, part in enumerate(("qkv", "z", "b", "a"))
        }
        loaders.update(self.state_loaders(prefix))
        loaders[f"{prefix}norm.weight"] = partial(copy_param, self.norm_weight)
        loaders[f"{prefix}out_proj.weight"] = self.out_proj.load_shard
        return loaders


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)
