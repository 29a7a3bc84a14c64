"""A decoder layer's elementwise steps (fused_ops.c), through ctypes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbus.model.native.build import load_library
from tokenbus.model.native.signatures import bind
from tokenbus.utils.cpu import CpuFeatures

_FUSED_SOURCE = Path(__file__).with_name("fused_ops.c")


@dataclass(frozen=True)
class FusedOps:
    """fp32 CPU elementwise steps of a decoder layer in one C call each (fused_ops.c)."""

    add_rms_norm_fn: ctypes._CFuncPtr
    rope_fn: ctypes._CFuncPtr
    silu_mul_fn: ctypes._CFuncPtr
    gelu_tanh_mul_fn: ctypes._CFuncPtr
    clamped_swiglu_mul_fn: ctypes._CFuncPtr
    ssm_decode_step_fn: ctypes._CFuncPtr
    gated_delta_rule_fn: ctypes._CFuncPtr

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual) for x [T, H] (residual None: x alone)."""
        assert x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
        assert residual is None or (residual.dtype == torch.float32 and residual.stride(1) == 1)
        num_tokens, hidden = x.shape
        residual_out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        self.add_rms_norm_fn(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            residual_out.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            num_tokens,
            hidden,
            ctypes.c_float(eps),
            torch.get_num_threads(),
        )
        return out, residual_out

    def rope_(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_rot_heads: int,
        head_dim: int,
        rotary_dim: int | None = None,
    ) -> None:
        """Rotate (rotate-half) the first num_rot_heads heads of each row of qkv [T, *] in place,
        by cos/sin [T, rotary_dim / 2] (contiguous): the first rotary_dim values of each head
        (default: all head_dim of them)."""
        rotary_dim = rotary_dim or head_dim
        assert qkv.dtype == cos.dtype == sin.dtype == torch.float32 and qkv.stride(1) == 1
        assert (
            cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == (qkv.shape[0], rotary_dim // 2)
            and rotary_dim % 2 == 0
            and rotary_dim <= head_dim
        )
        self.rope_fn(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            num_rot_heads,
            head_dim,
            rotary_dim,
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2I] (contiguous) -> [T, I]."""
        return _gated(self.silu_mul_fn, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up for gate_up [T, 2I] (contiguous) -> [T, I]."""
        return _gated(self.gelu_tanh_mul_fn, gate_up)

    def clamped_swiglu_mul(self, gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU (TorchOps.clamped_swiglu_mul) of gate_up [T, 2I] -> [T, I]."""
        return _gated(
            self.clamped_swiglu_mul_fn, gate_up, ctypes.c_float(limit), ctypes.c_float(alpha)
        )

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
        """TorchOps.ssm_decode_step_ in one C call: states [rows, H, P, N] (each row's S
        contiguous; rows strided), x [n, H, P] and b / c [n, G, N] with contiguous rows of any
        stride (views of the conv's output), dt [n, H], a and d [H]; all fp32 -> y [n, H, P]."""
        n, heads, dim = x.shape
        groups, size = b.shape[1:]
        assert states.dtype == x.dtype == torch.float32 and states[0].is_contiguous()
        assert x[0].is_contiguous() and b[0].is_contiguous() and b.stride(0) == c.stride(0)
        dt, a, d = dt.contiguous(), a.contiguous(), d.contiguous()
        rows = rows.contiguous()
        y = torch.empty(n, heads, dim, dtype=torch.float32)
        self.ssm_decode_step_fn(
            states.data_ptr(),
            states.stride(0),
            rows.data_ptr(),
            n,
            x.data_ptr(),
            x.stride(0),
            dt.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            c.data_ptr(),
            b.stride(0),
            d.data_ptr(),
            y.data_ptr(),
            heads,
            groups,
            dim,
            size,
            torch.get_num_threads(),
        )
        return y

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
        """TorchOps.gated_delta_rule_ in one C call, the tokens in order (each token's row:
        token_rows [T]): states [rows, Hv, dk, dv] (each row contiguous), q / k [T, Hk, dk],
        v [T, Hv, dv], g / beta [T, Hv]; all fp32 -> out [T, Hv, dv]."""
        tokens, k_heads, k_dim = q.shape
        v_heads, v_dim = v.shape[1:]
        assert states.dtype == q.dtype == torch.float32 and states[0].is_contiguous()
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        token_rows = token_rows.contiguous()
        out = torch.empty(tokens, v_heads, v_dim, dtype=torch.float32)
        self.gated_delta_rule_fn(
            states.data_ptr(),
            states.stride(0),
            token_rows.data_ptr(),
            tokens,
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            g.data_ptr(),
            beta.data_ptr(),
            out.data_ptr(),
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            int(tiled),
            torch.get_num_threads(),
        )
        return out


def _gated(fn: ctypes._CFuncPtr, gate_up: torch.Tensor, *params: ctypes.c_float) -> torch.Tensor:
    """fn(gate_up, T, I, *params, out, threads): a gated activation's one C call."""
    assert gate_up.dtype == torch.float32 and gate_up.is_contiguous() and gate_up.dim() == 2
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, size, dtype=torch.float32)
    fn(gate_up.data_ptr(), num_tokens, size, *params, out.data_ptr(), torch.get_num_threads())
    return out


def load_fused_ops(cpu: CpuFeatures | None = None) -> FusedOps:
    """Build (or find in the cache) and load fused_ops.c; NativeBuildError says why not."""
    lib = load_library(_FUSED_SOURCE, cpu)
    names = (
        *("add_rms_norm", "rope_inplace", "silu_mul", "gelu_tanh_mul", "clamped_swiglu_mul"),
        *("ssm_decode_step", "gated_delta_rule"),
    )
    return FusedOps(*(bind(lib, name) for name in names))
