"""RMSNorm with an optional fused residual add (the pre-norm decoder's pattern)."""

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
