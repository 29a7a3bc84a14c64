"""Save a random-weight HF checkpoint with SmolLM2's tokenizer beside it (so prompts and chat
templates work), for benchmarks that need weights on disk (an HF peer loads them too).

    .venv/bin/python benchmarks/make_random_model.py /tmp/llama-tp2
    .venv/bin/python benchmarks/make_random_model.py /tmp/lfm3 --config benchmarks/configs/lfm3-1.7b

Without --config: a Llama of SmolLM2's size whose heads divide by two (for tensor-parallel
benchmarks: SmolLM2's 9 query / 3 KV heads do not split in two): hidden 512, 8 query heads / 4
KV heads of 64, MLP 1536, 30 layers, vocab 49152, ~125 M parameters. With --config DIR: the
model of DIR/config.json (benchmarks/configs/: real models' shapes), in fp32. Every matrix is
drawn N(0, 1 / fan_in), so activations stay O(1) (HF's 0.02-std init gives near-uniform
logits); other parameters keep HF's init. A vocabulary larger than SmolLM2's is only partly
reachable from its tokenizer, which random prompts do not mind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.tiny_models import smollm2_gguf  # noqa: E402

TP_LLAMA = LlamaConfig(
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


def main(out: str, config_dir: str | None) -> None:
    torch.manual_seed(0)
    config = TP_LLAMA if config_dir is None else AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.save_pretrained(out)
    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default="/tmp/llama-tp2")
    parser.add_argument("--config", help="a directory holding the model's config.json")
    args = parser.parse_args()
    main(args.out, args.config)
