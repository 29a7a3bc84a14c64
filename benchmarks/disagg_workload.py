"""Writes the disaggregation benchmark's dataset (JSONL for `tokenbus bench serve
--dataset-path`): long prompts (1-2k random token ids, short answers) mixed with chat-sized
ones (50-200 tokens, longer streamed answers), shuffled, seeded.

    .venv/bin/python benchmarks/disagg_workload.py bench_out/disagg.jsonl --long 8 --chat 24
"""

from __future__ import annotations

import argparse
import json
import random


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--chat", type=int, default=24)
    parser.add_argument("--long-len", type=int, nargs=2, default=[1000, 2000])
    parser.add_argument("--chat-len", type=int, nargs=2, default=[50, 200])
    parser.add_argument("--long-output", type=int, default=32)
    parser.add_argument("--chat-output", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    rng = random.Random(ns.seed)

    def prompt(lo: int, hi: int) -> list[int]:
        return [rng.randrange(100, ns.vocab) for _ in range(rng.randint(lo, hi))]

    items = [
        {"prompt": prompt(*ns.long_len), "output_len": ns.long_output} for _ in range(ns.long)
    ] + [{"prompt": prompt(*ns.chat_len), "output_len": ns.chat_output} for _ in range(ns.chat)]
    rng.shuffle(items)
    with open(ns.out, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")


if __name__ == "__main__":
    main()
