"""Save a random-weight Llama of SmolLM2's size whose heads divide by two (for tensor-parallel
benchmarks: SmolLM2's 9 query / 3 KV heads do not split in two).

    .venv/bin/python benchmarks/make_random_model.py /tmp/llama-tp2

hidden 512, 8 query heads / 4 KV heads of 64, MLP 1536, 30 layers, vocab 49152 (SmolLM2's
tokenizer is saved beside it, so prompts and chat templates work): ~125 M parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.tiny_models import smollm2_gguf  # noqa: E402


def main(out: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # O(1) activations: HF's 0.02-std init gives near-uniform logits
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.save_pretrained(out)
    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama-tp2")
