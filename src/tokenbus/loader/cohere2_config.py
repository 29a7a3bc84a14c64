"""Cohere2 (Command R7B) and Cohere (Command R, Aya) shapes from GGUF metadata beyond the shared
ones (L2; no torch); the config.json side lives in hf_loader beside the other families' windows
and NoPE layers.

llama.cpp's `cohere2` graph fixes its pattern (every fourth layer global, load_swa_pattern 4),
turns no rotary on the global layers, and multiplies the logits by `cohere2.logit_scale`; its
`command-r` graph (Cohere's) has global layers only and the same scale. Both LayerNorms' epsilon
is `attention.layer_norm_epsilon` (not the RMS one).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from tokenbus.loader.layer_kinds import gguf_local_layers, global_nope_layers, windows

COHERE2_PATTERN = 4  # every fourth layer global (and without a rotary)
COHERE2_GGUF_EPS_KEY = "attention.layer_norm_epsilon"
COHERE_GGUF = "command-r"  # llama.cpp's name of Cohere's (v1) architecture
COHERE_GGUF_ARCHITECTURES = (COHERE_GGUF, "cohere2")


def cohere2_gguf_fields(
    meta: dict[str, Any], arch: str, num_layers: int, tensors: Container[str] = ()
) -> dict[str, Any]:
    """ModelArch fields of a cohere2 GGUF (windows on the local layers, NoPE on the global
    ones) or a command-r one (neither; Command R+'s per-head q/k norms where its tensors hold
    them), with the logits' scale as Granite's divisor."""
    fields: dict[str, Any] = dict(
        hidden_act="silu",
        logits_scaling=1.0 / float(meta.get(f"{arch}.logit_scale", 1.0)),
        attn_qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
    if arch == "cohere2":
        local = gguf_local_layers(meta, "cohere2", num_layers, COHERE2_PATTERN)
        fields["sliding_windows"] = windows(local, meta.get("cohere2.attention.sliding_window"))
        fields["nope_layers"] = global_nope_layers(local)
    return fields
