"""Helpers for speculative-decoding tests: engines with and without speculation, step stats."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from tokenbus import LLM

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}


def make_spec_llm(model, speculative_config=None, **engine_args) -> LLM:
    engine_args.setdefault("seed", 0)
    engine_args.setdefault("multiprocess", False)
    return LLM(
        None if model is None else str(model), speculative_config=speculative_config, **engine_args
    )


def spec_metrics(llm: LLM):
    """Sum the speculative-decoding stats of every engine step taken inside the block."""
    return llm.engine.measure_spec_decode()


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths; repetitive ones give the n-gram proposer matches, random ones don't."""
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    motif = rand(12)
    return [
        motif * 4,
        motif[:5] * 3 + rand(3),
        rand(30),
        rand(90),
        motif * 2 + rand(20),
        rand(3) * 3,
        rand(7),
        motif * 7,
    ]


def _rewrite(model_dir: Path, out_dir: Path, edit) -> Path:
    """Copy a tiny HF model dir with edit(weights, config) applied to its tensors and config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    weights = edit(weights, config)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def damped_model(model_dir: Path, out_dir: Path, num_full_layers: int, scale: float = 0.05) -> Path:
    """Layers from `num_full_layers` on add little to the residual stream, so the first layers
    alone predict the same tokens often: a model that early exit (self-speculation) suits."""

    def edit(weights, config):
        for name, tensor in weights.items():
            if (
                name.endswith(("o_proj.weight", "down_proj.weight"))
                and int(name.split(".")[2]) >= num_full_layers
            ):
                weights[name] = tensor * scale
        return weights

    return _rewrite(model_dir, out_dir, edit)


def truncated_copy(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """The model's first `num_layers` layers with its embeddings, final norm and head, as a
    separate checkpoint: drafts exactly what self-speculation with draft_layers=num_layers does."""

    def edit(weights, config):
        config["num_hidden_layers"] = num_layers
        return {
            name: tensor
            for name, tensor in weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }

    return _rewrite(model_dir, out_dir, edit)
