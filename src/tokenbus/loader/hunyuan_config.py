"""HunYuan dense shapes (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B, 1.8B, 4B, 7B; L2, no torch):
what its config.json and llama.cpp's `hunyuan-dense` GGUF say beyond Qwen3's.

- Its attention RMSNorms each query and key head after the rotary, under the names
  `query_layernorm` / `key_layernorm` (here q_norm / k_norm, as a GGUF names them too).
- Its rope is labelled "dynamic" with an NTK `alpha`: with alpha fixed the frequencies do not
  depend on the length (transformers' ntk_alpha): the base is rope_theta * alpha ** (D / (D - 2)).
  llama.cpp's converter writes that base as rope.freq_base, unscaled from then on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HUNYUAN_GGUF = "hunyuan-dense"
# its q/k norms under the names the model (and a GGUF) use
HUNYUAN_NORM_NAMES = {"query_layernorm": "q_norm", "key_layernorm": "k_norm"}


def hunyuan_rope(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config with its NTK-alpha rope as the plain rope of the stretched base."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "dynamic" or not params.get("alpha"):
        return config
    heads = int(config["num_attention_heads"])
    dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    base = theta * float(params["alpha"]) ** (dim / (dim - 2))
    return {**config, "rope_parameters": {"rope_type": "default", "rope_theta": base}}
