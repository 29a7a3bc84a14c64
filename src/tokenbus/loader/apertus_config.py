"""Apertus shapes (ApertusForCausalLM; L2, no torch at import): its norms' names and llama.cpp's
`apertus` GGUF's xIELU parameters.

- HF names a layer's norms attention_layernorm / feedforward_layernorm: loaded as the pre-norm
  layer's input_layernorm / post_attention_layernorm (a GGUF's attn_norm / ffn_norm are those).
- llama.cpp's converter moves each layer's four xIELU values (alpha_p, alpha_n, beta, eps, as
  stored: alpha_p and alpha_n before their softplus) out of the tensors into per-layer arrays,
  `xielu.{alpha_p,alpha_n,beta,eps}` (keys without the architecture); they are read back as
  the layer's tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

APERTUS_GGUF = "apertus"
# its layer norms under the pre-norm layer's names
APERTUS_NORM_NAMES = {
    "attention_layernorm": "input_layernorm",
    "feedforward_layernorm": "post_attention_layernorm",
}
_XIELU = {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()}  # HF's shapes


def apertus_gguf_xielu(meta: dict[str, Any], num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every layer's xIELU tensors from the GGUF's per-layer arrays."""
    import torch

    for name, shape in _XIELU.items():
        values = meta.get(f"xielu.{name}")  # llama.cpp's keys carry no architecture
        if values is None or len(values) != num_layers:
            raise ValueError(f"xielu.{name}: needs one value per layer")
        for layer, value in enumerate(values):
            tensor = torch.tensor(float(value), dtype=torch.float32).reshape(shape)
            yield f"model.layers.{layer}.mlp.act_fn.{name}", tensor
