"""Small building blocks of a Llama-family decoder."""

from tokenbus.model.layers.linear import LINEAR_BACKENDS, Linear, make_linear_kernel
from tokenbus.model.layers.norm import Fp32RMSNorm, LayerNorm, RMSNorm
from tokenbus.model.layers.ops import TORCH_OPS, FusedCpuOps, OpsModule, TorchOps
from tokenbus.model.layers.rotary import ROPE_TYPES, RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = [
    "LINEAR_BACKENDS",
    "Linear",
    "make_linear_kernel",
    "RMSNorm",
    "Fp32RMSNorm",
    "LayerNorm",
    "TORCH_OPS",
    "FusedCpuOps",
    "OpsModule",
    "TorchOps",
    "ROPE_TYPES",
    "RotaryEmbedding",
    "apply_rotary",
    "compute_inv_freq",
]
