"""gpt-oss shapes: what its config.json or GGUF metadata says beyond an MoE decoder's (L2; no
torch). hf_loader / gguf_loader join these ModelArch fields to the rest.

- The experts' clamped SwiGLU: config.json's `swiglu_limit` and `swiglu_alpha`; llama.cpp's
  `gpt-oss` graph fixes them (7 and 1.702, GptOssConfig's defaults too) and a GGUF stores
  neither.
- Windows: HF's `layer_types`; absent, every second layer is global (GptOssConfig's default and
  llama.cpp's swa pattern 2: the even layers slide). A GGUF stores the window as
  `gpt-oss.attention.sliding_window`.
- YaRN: OpenAI's reference (and transformers') keeps the correction range unrounded
  (`truncate: false`). llama.cpp rounds it to whole dimensions for every model; a GGUF's YaRN is
  read as the model was trained, unrounded.
- Stops: a harmony turn ends at `<|return|>` (the answer) or `<|call|>` (a tool call), as
  generation_config.json lists them; a GGUF names only the first as EOS. llama.cpp ends
  generation at both (its o200k_harmony end-of-generation set), and so do we.
"""

from __future__ import annotations

from typing import Any

from tokenbus.loader.layer_kinds import gguf_local_layers, windows

GPT_OSS_PATTERN = 2  # every second layer global
GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA = 7.0, 1.702
GPT_OSS_GGUF_ARCHITECTURE = "gpt-oss"  # llama.cpp's name; ours is "gpt_oss"
GPT_OSS_STOP_TOKENS = ("<|return|>", "<|call|>")


def gpt_oss_hf_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelArch fields of a gpt-oss config.json beyond the shared ones."""
    return dict(
        swiglu_limit=float(config.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)),
        swiglu_alpha=float(config.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)),
    )


def gpt_oss_gguf_fields(meta: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelArch fields of a gpt-oss GGUF beyond the shared ones (llama.cpp's fixed choices).
    The window is required, as llama.cpp requires it."""
    arch = GPT_OSS_GGUF_ARCHITECTURE
    if not meta.get(f"{arch}.attention.sliding_window"):
        raise ValueError(f"missing GGUF metadata {arch}.attention.sliding_window")
    local = gguf_local_layers(meta, arch, num_layers, GPT_OSS_PATTERN)
    return dict(
        hidden_act="silu",
        swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
        swiglu_alpha=GPT_OSS_SWIGLU_ALPHA,
        sliding_windows=windows(local, meta.get(f"{arch}.attention.sliding_window")),
    )
