"""The elementwise steps of a decoder layer, as one object a model's modules call.

A layer's norms, rotary, q/k norms and SiLU-times-up go through `module.ops`, never through a
kernel of the module's own choosing: the kernel plan (model/kernel_plan.py) picks the object
once at load and binds it to every `OpsModule`. `TorchOps` is the portable path (any device and
dtype: bit-equal to HF in fp32); `FusedCpuOps` runs native/fused_ops.c, one C call per step
instead of 3-6 ATen ops, on CPU in fp32. decode_layer.c calls the same C functions, so a layer
it runs and the same layer run op by op on FusedCpuOps agree bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenbus.model.layers.delta_rule import delta_rule
from tokenbus.model.layers.rotary import apply_rotary
from tokenbus.model.native import FusedOps

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TorchOps:
    """The portable path: torch ops on any device and dtype."""

    name = "torch"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (the running stream), then (rms_norm(residual) * weight, residual)."""
        residual = x if residual is None else residual + x
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    def add_rms_norm_fp32(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm with an fp32 `weight`, the norm computed in fp32 and cast back (Gemma's
        RMSNorm: (x * w).to(dtype), where Llama's is x.to(dtype) * w); in fp32, add_rms_norm."""
        if x.dtype == weight.dtype:
            return self.add_rms_norm(x, residual, weight, eps)
        residual = x if residual is None else residual + x
        normed = F.rms_norm(residual.to(weight.dtype), weight.shape, weight, eps)
        return normed.to(residual.dtype), residual

    def head_rms_norm_(
        self, qkv: torch.Tensor, first: int, count: int, weight: torch.Tensor, eps: float
    ) -> None:
        """RMSNorm over each of heads [first, first + count) of qkv [T, H, D], in place (Qwen3's
        q_norm / k_norm: one weight [D] for every head), in the weight's dtype (Gemma 3's fp32
        ones) and stored back in qkv's."""
        heads = qkv[:, first : first + count]
        heads.copy_(F.rms_norm(heads.to(weight.dtype), weight.shape, weight, eps))

    def rms_norm_columns_(
        self, flat: torch.Tensor, start: int, width: int, weight: torch.Tensor, eps: float
    ) -> None:
        """RMSNorm over columns [start, start + width) of each row of flat [T, N], in place
        (OLMo 2's q_norm / k_norm: all of a token's query or key heads at once), in the weight's
        dtype and stored back in flat's."""
        columns = flat[:, start : start + width]
        columns.copy_(F.rms_norm(columns.to(weight.dtype), weight.shape, weight, eps))

    def rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> QKV:
        """q, k rotated (rotate-half) and v, from qkv [T, Hq + 2 Hkv, D]; cos/sin [T, 1, R/2]
        (R < D: partial rotary, the first R dims of each head turn)."""
        num_qk_heads = num_heads + num_kv_heads
        qk = apply_rotary(qkv[:, :num_qk_heads], cos, sin)  # q and k rotated at once
        q, k = qk.split((num_heads, num_kv_heads), dim=1)
        return q, k, qkv[:, num_qk_heads:]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [..., 2I] -> [..., I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up for gate_up [..., 2I] -> [..., I] (GeGLU: HF's
        gelu_pytorch_tanh)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def clamped_swiglu_mul(self, gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
        """gpt-oss's experts' activation for gate_up [..., 2I] -> [..., I]: the gate clamped
        from above at `limit`, up to [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1),
        in HF's order of operations."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * tanh(x / cap), in HF's order (Gemma's final logit soft-capping)."""
        return torch.tanh(x / cap) * cap

    def ssm_decode_step_(
        self,
        states: torch.Tensor,
        rows: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
    ) -> torch.Tensor:
        """One token of each of n requests through Mamba2's recurrence (model/mamba2.py): their
        states S, rows `rows` of `states` [num_rows, H, P, N], advanced in place, for each head
        S = S exp(dt A) + dt x B^T (B, C [n, G, N]: a group for each H / G heads), and
        y [n, H, P] = S C + D x returned, in x's dtype (fp32: dt [n, H] after its softplus)."""
        per_group = x.shape[1] // b.shape[1]
        b, c = (t.to(x.dtype).repeat_interleave(per_group, dim=1) for t in (b, c))  # [n, H, N]
        s = states[rows].to(x.dtype)
        s = s * torch.exp(dt * a)[..., None, None] + (x * dt[..., None])[..., None] * b[:, :, None]
        states[rows] = s.to(states.dtype)
        return torch.einsum("nhpk,nhk->nhp", s, c) + d[:, None] * x

    def gated_delta_rule_(
        self,
        states: torch.Tensor,
        token_rows: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        tiled: bool,
    ) -> torch.Tensor:
        """T tokens through Gated DeltaNet's recurrence (model/gated_delta_net.py), in order,
        token t's states in row token_rows[t] of `states` [num_rows, Hv, dk, dv], advanced in
        place: per value head, S = S exp(g); S += k (beta (v - S^T k))^T; out = S^T q, with q / k
        [T, Hk, dk] of the value head's key head (grouped, or `tiled`), v [T, Hv, dv], g / beta
        [T, Hv] -> out [T, Hv, dv] in q's dtype (layers/delta_rule.py: decodes batched, chunks
        in the chunked form)."""
        per_key = v.shape[1] // q.shape[1]
        if tiled:  # [T, Hv, dk]: each value head's key head
            q, k = q.repeat(1, per_key, 1), k.repeat(1, per_key, 1)
        else:
            q, k = q.repeat_interleave(per_key, dim=1), k.repeat_interleave(per_key, dim=1)
        return delta_rule(states, token_rows, q, k, v, g, beta)


class FusedCpuOps(TorchOps):
    """fused_ops.c on CPU in fp32 (one C call each); torch for shapes it does not take, and
    for the step fused_ops.c does not have (softcap: Gemma's)."""

    name = "fused"

    def __init__(self, fused: FusedOps) -> None:
        self.fused = fused

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:
            return super().add_rms_norm(x, residual, weight, eps)
        return self.fused.add_rms_norm(x, residual, weight, eps)

    def head_rms_norm_(
        self, qkv: torch.Tensor, first: int, count: int, weight: torch.Tensor, eps: float
    ) -> None:
        # Rows of a norm are independent: the heads gathered as rows [T * count, D] give what
        # decode_layer.c computes head by head in place.
        heads = qkv[:, first : first + count]
        rows = heads.reshape(-1, qkv.shape[2])  # [T * count, D], a copy
        heads.copy_(self.fused.add_rms_norm(rows, None, weight, eps)[0].view(heads.shape))

    def rms_norm_columns_(
        self, flat: torch.Tensor, start: int, width: int, weight: torch.Tensor, eps: float
    ) -> None:
        # The columns are read in place (rows strided by flat's width), as decode_layer.c does.
        columns = flat[:, start : start + width]
        columns.copy_(self.fused.add_rms_norm(columns, None, weight, eps)[0])

    def rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> QKV:
        num_tokens, _, head_dim = qkv.shape
        num_qk_heads = num_heads + num_kv_heads
        flat = qkv.view(num_tokens, -1)  # [T, (Hq + 2 Hkv) * D]
        cos, sin = cos.view(num_tokens, -1), sin.view(num_tokens, -1)  # [T, R / 2]
        self.fused.rope_(flat, cos, sin, num_qk_heads, head_dim, 2 * cos.shape[-1])
        return qkv[:, :num_heads], qkv[:, num_heads:num_qk_heads], qkv[:, num_qk_heads:]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2:
            return super().silu_mul(gate_up)
        return self.fused.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2:
            return super().gelu_tanh_mul(gate_up)
        return self.fused.gelu_tanh_mul(gate_up)

    def clamped_swiglu_mul(self, gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
        if gate_up.dim() != 2:
            return super().clamped_swiglu_mul(gate_up, limit, alpha)
        return self.fused.clamped_swiglu_mul(gate_up, limit, alpha)

    # The mixers keep their states and run their recurrences in fp32 (fp32_state), so these
    # take every call of an fp32 model (the only one these ops serve).
    def ssm_decode_step_(self, states, rows, x, dt, a, b, c, d) -> torch.Tensor:
        return self.fused.ssm_decode_step_(states, rows, x, dt, a, b, c, d)

    def gated_delta_rule_(self, states, token_rows, q, k, v, g, beta, tiled) -> torch.Tensor:
        return self.fused.gated_delta_rule_(states, token_rows, q, k, v, g, beta, tiled)


TORCH_OPS = TorchOps()


class OpsModule(nn.Module):
    """A module whose elementwise steps go through `ops` (the torch path until the kernel plan
    binds another: model/kernel_plan.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: TorchOps = TORCH_OPS
