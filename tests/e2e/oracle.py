"""HF transformers as the correctness oracle."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tokenbus.bench.hf_peer import load_hf_model


@functools.lru_cache(maxsize=4)
def load_hf(model_dir: str, gguf_file: str | None = None):
    """An HF model directory, or `gguf_file` inside `model_dir`, in fp32 (cached)."""
    return load_hf_model(str(Path(model_dir) / gguf_file) if gguf_file else model_dir, "float32")


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one unpadded prompt, EOS ignored."""
    input_ids = torch.tensor([prompt_token_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_token_ids):].tolist()
