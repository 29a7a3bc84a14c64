"""Loading the same model into HF transformers, the peer and the correctness oracle (L6)."""

from __future__ import annotations

import torch

from tokenbus.loader import resolve_model

_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def load_hf_model(model: str | None, dtype: str = "auto"):
    from transformers import AutoModelForCausalLM

    source = resolve_model(model)
    torch_dtype = _DTYPES[dtype]
    if source.kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                  dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch_dtype)
    return hf.eval()
