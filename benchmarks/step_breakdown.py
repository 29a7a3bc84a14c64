"""Where an offline run of the c16 serving workload goes, step by step: 64 requests of random
prompts (20-600 tokens) and outputs (16-256, EOS ignored), at most 16 running (max_num_seqs),
EngineCore in this process. Prints the wall time, the time in pure-decode steps (mean step time
per batch size) and in steps that carry prefill chunks.

    .venv/bin/python benchmarks/step_breakdown.py [engine args as key=value ...]
    .venv/bin/python benchmarks/step_breakdown.py --fixed 16 300 200 [--gc-freeze]

e.g. `quant_activations=int16 kv_cache_dtype=float32` for the paths without AMX and fp16 K/V.
--fixed N P O runs N requests of P prompt and O output tokens instead (16 300 200: mostly
batch-16 decode steps); --gc-freeze freezes Python's GC generations after start-up.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import time

from tokenbus import LLM, SamplingParams
from tokenbus.utils.cpu import CpuFeatures
from tokenbus.worker.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="engine args as key=value")
    parser.add_argument("--fixed", type=int, nargs=3, metavar=("N", "PROMPT", "OUTPUT"))
    parser.add_argument("--gc-freeze", action="store_true")
    args = parser.parse_args()
    overrides = dict(arg.split("=", 1) for arg in args.overrides)
    print(
        f"CPU: {CpuFeatures.detect().describe()}; engine args {overrides or 'defaults'}"
        + (
            f"; {args.fixed[0]} requests of {args.fixed[1]} + {args.fixed[2]} tokens"
            if args.fixed
            else ""
        )
        + ("; gc frozen" if args.gc_freeze else "")
    )
    steps: list[tuple[int, int, float]] = []  # (decode tokens, prefill tokens, seconds)
    execute = ModelRunner._execute

    def timed(self, so):
        start = time.perf_counter()
        out = execute(self, so)
        counts = so.num_scheduled_tokens.values()
        steps.append(
            (
                sum(1 for n in counts if n == 1),
                sum(n for n in counts if n > 1),
                time.perf_counter() - start,
            )
        )
        return out

    ModelRunner._execute = timed
    rng = random.Random(0)
    llm = LLM(multiprocess=False, max_num_seqs=16, **overrides)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    prompts, params = [], []
    for _ in range(args.fixed[0] if args.fixed else 64):
        prompt_len = args.fixed[1] if args.fixed else rng.randint(20, 600)
        prompts.append({"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(prompt_len)]})
        out_len = args.fixed[2] if args.fixed else rng.randint(16, 256)
        params.append(
            SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
        )
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    steps.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.shutdown()
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    output_tokens = sum(p.max_tokens for p in params)
    decode = [s for s in steps if s[1] == 0]
    mixed = [s for s in steps if s[1] > 0]
    print(
        f"wall {wall:.1f} s: {prompt_tokens} prompt + {output_tokens} output tokens, "
        f"{(prompt_tokens + output_tokens) / wall:.0f} total tok/s, {len(steps)} steps"
    )
    print(
        f"pure decode steps: {len(decode)}, {sum(s[2] for s in decode):.1f} s; "
        f"steps with prefill: {len(mixed)}, {sum(s[2] for s in mixed):.1f} s "
        f"({sum(s[1] for s in mixed)} prefill + {sum(s[0] for s in mixed)} decode tokens)"
    )
    by_batch = collections.defaultdict(list)
    for tokens, _, seconds in decode:
        by_batch[tokens].append(seconds)
    print(
        "decode step, mean ms by batch size: "
        + ", ".join(f"{b}: {1e3 * sum(v) / len(v):.1f}" for b, v in sorted(by_batch.items()))
    )


if __name__ == "__main__":
    main()
