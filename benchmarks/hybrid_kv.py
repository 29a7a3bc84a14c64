"""The hybrid KV cache at long context: KV blocks held and decode speed of one request with one KV
group per window (core/kv/hybrid.py) against every layer held whole
(--disable-hybrid-kv-cache-manager), on the same model and engine settings.

The model: a random Qwen2 of Gemma 3's layer pattern, 5 sliding-window layers (window --window)
to 1 full-attention layer, --layers layers of hidden 256 (4 query / 2 KV heads of 64), fp32 on
CPU with the native attention kernel. One request of --context - --max-tokens random prompt
tokens generates --max-tokens greedy tokens (EOS ignored), so the last step runs at --context.
Variants alternate over --rounds, each in a fresh engine:
  hybrid   one KV group per window: sliding groups hand back out-of-window blocks
  global   every layer's blocks held for the whole context (windows still masked)
Reported: the pool's blocks held and their MiB at the last decode step (a block of the hybrid
cache is a page of one layer per group, of the global one a page of every layer: MiB compare
them), and decode tok/s (the steps after the prompt, median over rounds). With 5 : 1 and window
W, the bytes held shrink by at most 6 C / (C + 5 W) at context C (3.7x at 8k, W 1024).

    .venv/bin/python benchmarks/hybrid_kv.py [--context 8192] [--record benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from tests.fixtures.tiny_models import make_tiny_model  # noqa: E402

from tokenbus import LLM, SamplingParams  # noqa: E402
from tokenbus.bench.record import make_record, record_dir, this_command, write_record  # noqa: E402
from tokenbus.core.kv.hybrid import layer_windows, plan_kv_groups  # noqa: E402
from tokenbus.loader import load_arch, resolve_model  # noqa: E402
from tokenbus.worker.kv_cache import bytes_per_block  # noqa: E402

VARIANTS = ("hybrid", "global")
BLOCK_SIZE = 16


def make_model(path: Path, layers: int, window: int, context: int) -> Path:
    """A random Qwen2 whose every sixth layer is global, the rest sliding."""
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    return make_tiny_model(
        path,
        "qwen2",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context + BLOCK_SIZE,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
        layer_types=types,
    )


def run_variant(args, model: Path, variant: str, prompt: list[int]) -> dict[str, float]:
    llm = LLM(
        str(model),
        seed=0,
        multiprocess=False,
        kv_cache_dtype="float32",
        attention_backend="native",
        block_size=BLOCK_SIZE,
        max_model_len=args.context + BLOCK_SIZE,
        max_num_batched_tokens=2048,
        max_num_seqs=1,
        enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=variant == "global",
    )
    try:
        core = llm.engine.client.engine_core
        pool = core.kv_cache_manager.block_pool
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        engine.add_request("long", prompt, params)
        held, first_token_at, generated = 0, None, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first_token_at is None and core.scheduler.requests.get("long") is not None:
                request = core.scheduler.requests["long"]
                if request.num_output_tokens > 0:
                    first_token_at = time.perf_counter()
            if "long" in core.scheduler.requests:
                held = pool.num_blocks - 1 - pool.num_free_blocks  # at the latest context
            for out in outputs:
                generated = len(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - first_token_at
    finally:
        llm.shutdown()
    arch = load_arch(resolve_model(str(model)))
    groups = plan_kv_groups(layer_windows(arch), hybrid=variant == "hybrid")
    per_block = bytes_per_block(arch, BLOCK_SIZE, torch.float32, groups)
    return {
        "blocks": held,
        "mib": held * per_block / 2**20,
        "decode": (generated - 1) / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--record", default=None, help="write a record under DIR/hybrid_kv/")
    args = parser.parse_args()

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.context - args.max_tokens)]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="tokenbus-hybrid-kv-") as tmp:
        model = make_model(Path(tmp) / "model", args.layers, args.window, args.context)
        for round_index in range(args.rounds):
            order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                result = run_variant(args, model, variant, prompt)
                results[variant].append(result)
                print(f"round {round_index + 1} {variant:7s} {result}", flush=True)
    rows = {}
    base = {
        key: statistics.median(r[key] for r in results["global"]) for key in results["global"][0]
    }
    for variant in VARIANTS:
        median = {key: statistics.median(r[key] for r in results[variant]) for key in base}
        rows[variant] = {
            "KV blocks held": int(median["blocks"]),
            "KV MiB held": round(median["mib"], 1),
            "KV bytes vs global": round(base["mib"] / median["mib"], 2),
            "decode": round(median["decode"], 1),
            "decode vs global": round(median["decode"] / base["decode"], 3),
        }
        print(variant, rows[variant])
    directory = record_dir(args.record)
    if directory:
        record = make_record(
            "hybrid_kv",
            this_command(),
            rows,
            units={
                "KV MiB held": "MiB",
                "KV bytes vs global": "×",
                "decode": "tok/s",
                "decode vs global": "×",
            },
            peers=["tokenbus --disable-hybrid-kv-cache-manager (global)", "alternated"],
            variant=f"context {args.context}, window {args.window}, {args.layers} layers 5:1",
        )
        write_record(directory, record)


if __name__ == "__main__":
    main()
