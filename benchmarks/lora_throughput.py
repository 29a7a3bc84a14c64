"""LoRA serving cost: offline throughput of one batch whose requests use four adapters against
the same batch on the base model, on the same engine settings.

The adapters are random PEFT-format files of the model's shape, written here with safetensors.
Variants, each in a fresh engine, in alternating order over --rounds:
  base       the base model, --enable-lora off
  lora-off   --enable-lora --max-loras 4, every request on the base model (what enabling costs)
  4-loras    the requests spread round robin over four adapters of rank --rank on all seven
             projections of every layer: the worst case for the side path
  4-loras-qv the same over four rank-8 adapters on q_proj and v_proj (PEFT's defaults for a
             Llama model)
Each round generates --requests prompts of --prompt-tokens random tokens, --max-tokens greedy
tokens each (EOS ignored), all at once; tok/s counts prompt and generated tokens over the wall
time of the whole batch (median over rounds).

    .venv/bin/python benchmarks/lora_throughput.py [--rounds 3] [--record DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tokenbus import LLM, LoRARequest, SamplingParams  # noqa: E402
from tokenbus.bench.record import make_record, record_dir, this_command, write_record  # noqa: E402
from tokenbus.loader import load_arch, resolve_model  # noqa: E402
from tokenbus.loader.lora import TARGET_MODULES, module_shape  # noqa: E402

VARIANTS = ("base", "lora-off", "4-loras", "4-loras-qv")
QV_TARGETS = ("q_proj", "v_proj")


def write_adapter(
    path: Path, arch, rank: int, seed: int, targets: tuple[str, ...] = TARGET_MODULES
) -> Path:
    """A random rank-`rank` adapter on `targets` of every layer, as PEFT saves one."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for target in targets:
            scope = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            module = f"model.layers.{layer}.{scope}.{target}"
            in_features, out_features = module_shape(arch, module)
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                0.1 * torch.randn(out_features, rank, generator=generator) / rank**0.5
            )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(targets),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def run_variant(args, variant: str, adapters: dict[str, list[LoRARequest]], prompts) -> float:
    engine = dict(max_num_seqs=max(args.requests, 1), seed=0)
    if variant != "base":
        engine.update(enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    llm = LLM(args.model, **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        group = adapters.get(variant)
        loras = [group[i % len(group)] for i in range(len(prompts))] if group else None
        # Warm-up: each adapter read once, the kernels built.
        llm.generate(
            prompts[:4],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
            lora_request=loras[:4] if loras else None,
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--record", default=None, help="write a record under DIR/lora/")
    args = parser.parse_args()

    arch = load_arch(resolve_model(args.model))
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]}
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory(prefix="tokenbus-loras-") as tmp:
        adapters = {
            "4-loras": [
                LoRARequest(
                    f"all{i}", str(write_adapter(Path(tmp) / f"all{i}", arch, args.rank, i))
                )
                for i in range(4)
            ],
            "4-loras-qv": [
                LoRARequest(
                    f"qv{i}", str(write_adapter(Path(tmp) / f"qv{i}", arch, 8, i, QV_TARGETS))
                )
                for i in range(4)
            ],
        }
        results: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for round_index in range(args.rounds):
            order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                rate = run_variant(args, variant, adapters, prompts)
                results[variant].append(rate)
                print(f"round {round_index + 1} {variant:10s} {rate:8.1f} tok/s", flush=True)
    base = statistics.median(results["base"])
    rows = {}
    for variant in VARIANTS:
        rate = statistics.median(results[variant])
        rows[variant] = {"throughput": round(rate, 1), "vs base": round(rate / base, 3)}
        print(f"{variant:10s} {rate:8.1f} tok/s  {rate / base:.3f}x base")
    directory = record_dir(args.record)
    if directory:
        record = make_record(
            "lora",
            this_command(),
            rows,
            units={"throughput": "tok/s", "vs base": "×"},
            peers=["tokenbus without --enable-lora (base)", "alternated"],
        )
        write_record(directory, record)


if __name__ == "__main__":
    main()
