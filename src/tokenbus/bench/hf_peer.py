"""Loading the same model into HF transformers, the peer and the correctness oracle (L6)."""

from __future__ import annotations

import torch

from tokenbus.engine.setup import resolve_dtype
from tokenbus.loader import resolve_model


def load_hf_model(model: str | None, dtype: str = "auto"):
    """The model in HF transformers, on the CPU (where it is loaded), in our `dtype` for that
    device: `auto` is float32 there, as for our own engine on a CPU."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(model)
    torch_dtype = getattr(torch, resolve_dtype(dtype, "cpu"))
    if source.kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch_dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch_dtype)
    if getattr(hf.config, "attn_logit_softcapping", None) is not None:
        # Gemma 2's scores are soft-capped, which only HF's eager attention does; some
        # transformers versions (5.17) give such a model SDPA by default all the same.
        hf.set_attn_implementation("eager")
    return hf.eval()
