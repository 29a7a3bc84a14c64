"""RMSNorm with an optional fused residual add (the pre-norm decoder's pattern), the one whose
weight stays fp32 (Gemma's and OLMo 2's), and LayerNorm (Cohere's without a bias, PhiMoE's
with one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenbus.model.layers.ops import OpsModule


class RMSNorm(OpsModule):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim (bit-equal to HF's in fp32 on the
    torch path; to rounding on the fused C one)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (the running stream), then return (norm(residual), residual)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Fp32RMSNorm(RMSNorm):
    """x / rms(x) * weight computed in fp32, cast back to x's dtype; the weight held in fp32
    (HF's Gemma2RMSNorm / Gemma3RMSNorm / Olmo2RMSNorm: (x * w).to(dtype), where Llama's is
    x.to(dtype) * w). In an fp32 model it is a plain RMSNorm, and the fused C op runs it."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm_fp32(x, None, self.weight, self.eps)[0]

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm_fp32(x, residual, self.weight, self.eps)


class LayerNorm(OpsModule):
    """(x - mean) / sqrt(var + eps) * weight over the last dim; without `bias` computed in fp32
    and cast back: HF's CohereLayerNorm / Cohere2LayerNorm op for op (the variance taken around the
    mean, then rsqrt), so an fp32 model gives its values bit for bit. The same interface as
    RMSNorm (forward, add_and_norm); the C ops take only RMSNorms. `hidden_size` may be a
    shape, (heads, D): each head of x [..., heads, D] then takes its own row of the weight
    (Command R+'s q/k norms: CohereLayerNorm of shape (heads, head_dim)). With `bias`, torch's
    own layer norm plus a bias, in x's dtype: nn.LayerNorm's (PhiMoE's)."""

    def __init__(self, hidden_size: int | tuple[int, int], eps: float, bias: bool = False) -> None:
        super().__init__()
        if bias and not isinstance(hidden_size, int):  # F.layer_norm would span every head
            raise ValueError(f"a LayerNorm with a bias norms one dim, not {hidden_size}")
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.to(torch.float32) * h).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x (the running stream), then (norm(stream), stream)."""
        residual = x if residual is None else residual + x
        return self.forward(residual), residual
