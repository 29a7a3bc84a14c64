"""q/k rows between the two rotary layouts (L2): llama.cpp's `permute` (each head's dims as
interleaved pairs, GPT-J's layout, which llama.cpp's "norm" rope turns) and HF's rotate-half
halves (NeoX's, which our rotary turns). A Llama GGUF's rows are permuted by its converter; ERNIE
4.5's, GLM-4's and Cohere2's checkpoints hold interleaved rows themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def unpermute_qk(
    weight: torch.Tensor, num_heads: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """Undo llama.cpp's `permute`: per head, rows (pairs interleaved) -> (first halves, second
    halves); with `rotary_dim` (a partial rotary: GLM-4's), only each head's first rotary_dim
    rows, the rest as they are.

    llama.cpp: w.reshape(H, 2, D/2, ...).swapaxes(1, 2); the inverse is the same with (D/2, 2).
    Works for weights [H*D, in] and biases [H*D].
    """
    import torch

    head_dim = weight.shape[0] // num_heads
    rotary_dim = rotary_dim or head_dim
    heads = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    turned = (
        heads[:, :rotary_dim]
        .reshape(num_heads, rotary_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(num_heads, rotary_dim, *weight.shape[1:])
    )
    return torch.cat((turned, heads[:, rotary_dim:]), dim=1).reshape(weight.shape)


# HF names of q/k norm weights, which Command R+ holds per head [heads, D] (unpermute_head_rows)
PER_HEAD_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


def unpermute_head_rows(weight: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """unpermute_qk of a weight per head [heads, D] (Command R+'s q/k LayerNorms): each head's
    D values reordered as its q/k rows are."""
    heads = weight.shape[0]
    return unpermute_qk(weight.reshape(-1), heads, rotary_dim).reshape(weight.shape)


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation (HF rotate-half rows -> interleaved pairs)."""
    rows = weight.shape[0]
    half_dim = rows // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half_dim, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
