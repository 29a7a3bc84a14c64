"""Single-stream decode (tg128) and prompt processing (pp512) on the default model, tokenbus
measured the way llama-bench measures them, with llama-bench in the same run.

    .venv/bin/python benchmarks/cpu_speed.py [--quantization auto|gguf|none]
        [--quant-activations auto|int16|int8|fp32] [--enforce-eager] [--num-threads N] [--peer]
        [--reps 3]

tg128: 128 greedy tokens after a 1-token prompt, timed as (time for 129 tokens) - (time for 1),
so prefill is excluded, as llama-bench's tg test has no prompt. pp512: a 512-token random prompt
and one output token. Each is the best of --reps runs after one warm-up (llama-bench -r 3
reports the mean; both are printed with the CPU). --peer runs benchmarks/peers/llama_cpp.sh bench.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import time
from pathlib import Path

from tokenbus import LLM, SamplingParams
from tokenbus.bench.record import make_record, record_dir, this_command, write_record
from tokenbus.utils.cpu import CpuFeatures


def timed(llm: LLM, prompt: list[int], max_tokens: int) -> float:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
    )
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant-activations", default="auto")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="every layer op by op (no C decode layers)"
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="engine threads (default: the usable cores)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peer", action="store_true", help="also run llama-bench on the same GGUF")
    parser.add_argument(
        "--record", default=None, metavar="DIR", help="write a run record under DIR/cpu_speed/"
    )
    args = parser.parse_args()
    print(f"CPU: {CpuFeatures.detect().describe()}")
    llm = LLM(
        quantization=args.quantization,
        dtype=args.dtype,
        quant_activations=args.quant_activations,
        enforce_eager=args.enforce_eager,
        num_threads=args.num_threads,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    short, long = [rng.randrange(1000, 40000)], [rng.randrange(1000, 40000) for _ in range(512)]
    timed(llm, short, 16), timed(llm, long, 1)  # warm-up (kernels built, caches filled)
    tg = min(timed(llm, short, 129) - timed(llm, short, 1) for _ in range(args.reps))
    pp = min(timed(llm, long, 1) for _ in range(args.reps))
    llm.shutdown()
    print(
        f"tokenbus quantization={args.quantization} dtype={args.dtype} "
        f"quant_activations={args.quant_activations} "
        f"enforce_eager={args.enforce_eager} num_threads={args.num_threads}: "
        f"tg128 {128 / tg:.1f} tok/s, pp512 {512 / pp:.1f} tok/s"
    )
    peer = ""
    if args.peer:
        script = Path(__file__).with_name("peers") / "llama_cpp.sh"
        peer = subprocess.run(
            ["bash", str(script), "bench"], capture_output=True, text=True, check=True
        ).stdout
        print(peer)
    if record_dir(args.record):
        write_record(record_dir(args.record), speed_record(args, 128 / tg, 512 / pp, peer))


def speed_record(args: argparse.Namespace, tg: float, pp: float, peer: str) -> dict:
    """tg128 and pp512 as a run record, beside llama-bench's means where it ran."""
    peer_rates = {}  # llama-bench's markdown rows: "| ... | pp512 | 362.00 ± 4.00 |"
    for line in peer.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[-2] in ("tg128", "pp512"):
            peer_rates[cells[-2]] = cells[-1]
    rows = {}
    for test, rate in (("tg128", tg), ("pp512", pp)):
        cells = {"tokenbus": round(rate, 1)}
        if test in peer_rates:
            cells["llama.cpp"] = peer_rates[test]
            cells["tokenbus / llama.cpp"] = round(rate / float(peer_rates[test].split()[0]), 2)
        rows[test] = cells
    settings = {
        "quantization": args.quantization,
        "dtype": args.dtype,
        "quant_activations": args.quant_activations,
    }
    variant = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items() if v != "auto")
    variant += " --enforce-eager" * args.enforce_eager
    variant += f" --num-threads {args.num_threads}" if args.num_threads else ""
    units = {"tg128": "tok/s", "pp512": "tok/s", "tokenbus / llama.cpp": "×"}
    peers = ["llama.cpp (llama-bench -t 2 -r 3, mean)"] if peer_rates else []
    return make_record(
        "cpu_speed", this_command(), rows, units=units, peers=peers, variant=variant.strip()
    )


if __name__ == "__main__":
    main()
