"""MiniCPM3 shapes (MiniCPM3ForCausalLM: MiniCPM3-4B; L2, no torch): what its config.json and
llama.cpp's `minicpm3` GGUF say beyond a Llama's. hf_loader / gguf_loader join these ModelArch
fields to the rest.

- Attention: DeepSeek-V2's multi-head latent attention (model/mla.py; the cache holds one KV
  head of kv_lora_rank + qk_rope_head_dim values, head_dim here) with the queries through a
  bottleneck, its rotary turning halves of the rotary dims (NeoX's layout, not DeepSeek's
  pairs), LongRoPE factors over those dims; values of v_head_dim (hidden / heads by default).
- A dense SiLU MLP in every layer, and muP's three scales, Granite's multipliers here
  (model/granite.py): the embeddings times `scale_emb`, each sublayer's output times
  `scale_depth` / sqrt(layers) before it joins the residual, the logits divided by hidden /
  `dim_model_base`. llama.cpp's graph fixes them at the released model's 12, 1.4 and 256, and
  its GGUF records none.
- The GGUF keeps the heads' own sizes (head_count_kv the query heads', key_length qk_nope +
  qk_rope), kv_b_proj whole, the LongRoPE factors as rope_factors_long / _short.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tokenbus.loader.deepseek_config import latent_cache_fields

MINICPM3_GGUF = "minicpm3"
# MiniCPM3Config's defaults, the released model's (llama.cpp's graph fixes the same)
_SCALE_EMB, _SCALE_DEPTH, _DIM_MODEL_BASE = 12.0, 1.4, 256


def minicpm3_hf_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a MiniCPM3ForCausalLM config beyond the shared ones."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
        if not config.get(key):
            raise ValueError(f"{path}: a MiniCPM3ForCausalLM config needs {key!r}")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    kv_lora_rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    depth = config.get("scale_depth", _SCALE_DEPTH)
    return dict(
        q_lora_rank=int(config.get("q_lora_rank", 768) or 0),
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        v_head_dim=int(config.get("v_head_dim") or hidden // heads),
        mla_rope_interleaved=False,
        **latent_cache_fields(kv_lora_rank, rope),
        **_multipliers(
            hidden,
            layers,
            float(config.get("scale_emb", _SCALE_EMB)),
            math.sqrt(layers) if depth is None else float(depth),
            int(config.get("dim_model_base") or hidden),
        ),
    )


def minicpm3_gguf_fields(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch fields of a minicpm3 GGUF beyond the shared ones: the latent cache's shape in
    place of the heads' (key_length, head_count_kv), the value heads' size, llama.cpp's fixed
    scales."""
    arch = MINICPM3_GGUF

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    rope, kv_lora_rank = int(need("rope.dimension_count")), int(need("attention.kv_lora_rank"))
    layers = int(need("block_count"))
    return dict(
        q_lora_rank=int(need("attention.q_lora_rank")),
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=int(need("attention.key_length")) - rope,
        # llama.cpp's default value length: hidden / heads (the converter writes none)
        v_head_dim=int(meta.get(f"{arch}.attention.value_length", hidden // heads)),
        mla_rope_interleaved=False,  # llama.cpp's NEOX rope for minicpm3
        **latent_cache_fields(kv_lora_rank, rope),
        **_multipliers(hidden, layers, _SCALE_EMB, _SCALE_DEPTH, _DIM_MODEL_BASE),
    )


def _multipliers(
    hidden: int, layers: int, scale_emb: float, scale_depth: float, dim_model_base: int
) -> dict[str, float]:
    """muP's scales as Granite's multipliers (model/granite.py)."""
    return dict(
        embedding_multiplier=scale_emb,
        residual_multiplier=scale_depth / math.sqrt(layers),
        logits_scaling=hidden / dim_model_base,
    )
