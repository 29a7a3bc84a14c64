"""Single-stream decode (tg128) and prompt processing (pp512), tokenbus measured the way
llama-bench measures them, with llama-bench on the same GGUF in the same run: the default model,
or any GGUF files (--model, one run each).

    .venv/bin/python benchmarks/cpu_speed.py [--model FILE ...] [--peer] [--reps 3]
        [--quantization auto|gguf|none] [--quant-activations auto|int16|int8|fp32]
        [--attention-backend auto|native|torch]
        [--enforce-eager] [--num-threads N] [--max-model-len 4096]

tg128: 128 greedy tokens after a 1-token prompt, timed as (time for 129 tokens) - (time for 1),
so prefill is excluded, as llama-bench's tg test has no prompt. pp512: a 512-token random prompt
and one output token. After one warm-up, each of --reps rounds times tokenbus's tg128 and pp512
once and then (--peer) runs `benchmarks/peers/llama_cpp.sh bench FILE -r 1` (llama-bench -t 2
-p 512 -n 128, its own warm-up included); both sides report their best round. Alternating
rounds puts the load of whatever else shares the machine on both sides alike; the best round is
the one least disturbed. A file tokenbus does not load (a quant type it refuses) is recorded as
refused, beside llama.cpp's figures. The default model's record is topic cpu_speed; --model
files' are topic gguf_speed, one per file (the file's name is the record's setting).

Decode streams every weight once a token, so tg128 is bound by how fast the cores read memory:
each round also times a read of 1 GiB (torch's sum over fp32 values, best of 3) and the rate
such reads keep up for 4 s (about one tg128 of an 8B file), and the tg128 row gives both (the
best round's) beside the rate each engine streams the file's weights
at (tok/s x the bytes a token reads: every tensor but the token embedding, whose one row a
token reads, unless it is also the LM head; of MoE expert tensors, the top-k experts' share).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import time
from pathlib import Path

import torch

from tokenbus import LLM, SamplingParams
from tokenbus.bench.record import make_record, record_dir, this_command, write_record
from tokenbus.loader.gguf_file import read_gguf
from tokenbus.loader.source import packaged_smollm2_gguf
from tokenbus.utils.cpu import CpuFeatures

LLAMA_CPP = Path(__file__).with_name("peers") / "llama_cpp.sh"
TESTS = {(512, 0): "pp512", (0, 128): "tg128"}  # llama-bench's (n_prompt, n_gen) -> test


def timed(llm: LLM, prompt: list[int], max_tokens: int) -> float:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
    )
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def llama_bench(gguf: Path) -> tuple[dict[str, float], str]:
    """One llama-bench round on `gguf`: {test: tok/s} and llama.cpp's build commit."""
    out = subprocess.run(
        ["bash", str(LLAMA_CPP), "bench", str(gguf), "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_llama_bench(out)


def read_rate(gib: int = 1, repeats: int = 3, seconds: float = 4.0) -> tuple[float, float]:
    """GB/s the cores read memory at: torch's sum of `gib` GiB of fp32 (past every cache), the
    best of `repeats`; and the mean rate of such sums kept up for `seconds`."""
    data = torch.ones(gib * 2**28)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    start, sums = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        data.sum()
        sums += 1
    gb = data.numel() * 4 / 1e9
    return gb / best, gb * sums / (time.perf_counter() - start)


def streamed_bytes(gguf: Path) -> float:
    """Bytes of weights a decoded token reads: every tensor but the lookup tables it reads a
    row of, token_embd (read whole where it is also the LM head: no output tensor) and Gemma
    3n's per-layer table; of an MoE layer's expert tensors (*_exps), the share its top-k
    experts hold."""
    file = read_gguf(gguf)
    arch = file.metadata.get("general.architecture", "")
    experts = file.metadata.get(f"{arch}.expert_count")
    used = file.metadata.get(f"{arch}.expert_used_count")
    share = used / experts if experts and used else 1.0
    tied = "output.weight" not in file.tensors
    lookups = {"per_layer_token_embd.weight", *(() if tied else ("token_embd.weight",))}
    return sum(
        t.nbytes * (share if "_exps." in name else 1.0)
        for name, t in file.tensors.items()
        if name not in lookups
    )


def parse_llama_bench(out: str) -> tuple[dict[str, float], str]:
    """llama-bench -o json's tests as {"tg128" | "pp512": tok/s}, and its build commit."""
    results = json.loads(out)
    rates = {TESTS[(r["n_prompt"], r["n_gen"])]: r["avg_ts"] for r in results}
    return rates, results[0].get("build_commit", "")


def refusal(error: Exception) -> str:
    """The reason a file did not load, without its path (which the record's setting names)."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    text = text.split(".gguf: ", 1)[-1]
    return "refused: " + text.split(" (supported:", 1)[0]


def measure(args: argparse.Namespace, model: str | None) -> dict:
    """Rounds of tokenbus (and llama-bench) on one model; the run's record."""
    gguf = Path(model) if model else packaged_smollm2_gguf()
    load = os.getloadavg()[0]  # before this file's run: the machine is shared
    print(f"== {gguf.name} ({gguf.stat().st_size / 2**30:.2f} GiB); load average {load:.2f}")
    refused = ""
    try:
        llm = LLM(
            model,
            quantization=args.quantization,
            dtype=args.dtype,
            quant_activations=args.quant_activations,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            num_threads=args.num_threads,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
        )
    except Exception as exc:  # noqa: BLE001 - a file the engine refuses is a result too
        llm, refused = None, refusal(exc)
        print(f"tokenbus: {refused}")
    rng = random.Random(0)
    short, long = [rng.randrange(1000, 40000)], [rng.randrange(1000, 40000) for _ in range(512)]
    if llm is not None:
        timed(llm, short, 16), timed(llm, long, 1)  # warm-up (kernels built, caches filled)
    ours: dict[str, list[float]] = {"tg128": [], "pp512": []}
    peer: dict[str, list[float]] = {"tg128": [], "pp512": []}
    commit, reads = "", []
    for n in range(args.reps):
        reads.append(read_rate())
        print(f"round {n + 1}: memory read {reads[-1][0]:.1f} GB/s, over 4 s {reads[-1][1]:.1f}")
        if llm is not None:
            ours["tg128"].append(128 / (timed(llm, short, 129) - timed(llm, short, 1)))
            ours["pp512"].append(512 / timed(llm, long, 1))
            print(
                f"round {n + 1}: tokenbus tg128 {ours['tg128'][-1]:.1f}, "
                f"pp512 {ours['pp512'][-1]:.1f} tok/s"
            )
        if args.peer:
            rates, commit = llama_bench(gguf)
            for test, rate in rates.items():
                peer[test].append(rate)
            print(
                f"round {n + 1}: llama.cpp tg128 {rates['tg128']:.1f}, "
                f"pp512 {rates['pp512']:.1f} tok/s"
            )
    if llm is not None:
        llm.shutdown()
    best = {test: max(rates) for test, rates in ours.items() if rates}
    best_peer = {test: max(rates) for test, rates in peer.items() if rates}
    print(f"best of {args.reps}: tokenbus {best or refused}, llama.cpp {best_peer or '-'}")
    record = speed_record(args, model, best or refused, best_peer, commit, load)
    streamed = streamed_bytes(gguf) / 1e9
    stream = record["rows"]["tg128"]
    stream["memory read (GB/s)"] = round(max(r[0] for r in reads), 1)
    stream["memory read over 4 s (GB/s)"] = round(max(r[1] for r in reads), 1)
    for engine, rates in (("tokenbus", best), ("llama.cpp", best_peer)):
        if "tg128" in rates:
            stream[f"{engine} streams (GB/s)"] = round(rates["tg128"] * streamed, 1)
    return record


def speed_record(
    args: argparse.Namespace,
    model: str | None,
    ours: dict[str, float] | str,
    peer: dict[str, float],
    commit: str = "",
    load: float | None = None,
) -> dict:
    """tg128 and pp512 as a run record (`ours` a refusal's text where tokenbus did not load
    the file), beside llama-bench's best round where it ran; a file's first row also gives the
    load average when its run began (`load`)."""
    rows = {}
    for test in ("tg128", "pp512"):
        rate = ours if isinstance(ours, str) else ours[test]
        cells = {"tokenbus": rate if isinstance(rate, str) else round(rate, 1)}
        if test in peer:
            cells["llama.cpp"] = round(peer[test], 1)
            if not isinstance(rate, str):
                cells["tokenbus / llama.cpp"] = round(rate / peer[test], 2)
        rows[test] = cells
    settings = {
        "quantization": args.quantization,
        "dtype": args.dtype,
        "quant_activations": args.quant_activations,
        "attention_backend": args.attention_backend,
    }
    variant = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items() if v != "auto")
    variant += " --enforce-eager" * args.enforce_eager
    variant += f" --num-threads {args.num_threads}" if args.num_threads else ""
    if model:  # the file first: one row per file in the table
        size = Path(model).stat().st_size / 2**30
        variant = f"{Path(model).name} ({size:.2f} GiB) {variant.strip()}"
        if load is not None:
            rows["tg128"]["load average"] = round(load, 2)
    units = {"tg128": "tok/s", "pp512": "tok/s", "tokenbus / llama.cpp": "×"}
    peers = []
    if peer:
        build = f"llama.cpp {commit}".strip()
        peers = [
            f"{build} (llama-bench -t 2 -r 1 per round, best of {args.reps} rounds "
            "alternated with tokenbus's)"
        ]
    topic = "gguf_speed" if model else "cpu_speed"
    record = make_record(
        topic, this_command(), rows, units=units, peers=peers, variant=variant.strip()
    )
    return record


def record_name(record: dict, model: Path) -> str:
    """<date>-<file stem>, then the run's flags (its variant past the file) as a slug: a run
    with other flags on the same file and day (--enforce-eager, say) keeps its own record."""
    flags = record["variant"].split(") ", 1)[1] if ") " in record["variant"] else ""
    slug = "".join(c if c.isalnum() else "-" for c in flags.replace("--", "")).strip("-")
    return f"{record['date'][:10]}-{model.stem}" + (f"-{slug}" if slug else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", nargs="+", default=[None], metavar="FILE", help="GGUF files (default model)"
    )
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant-activations", default="auto")
    parser.add_argument(
        "--attention-backend", default="auto", help="torch: no native kernel, no C decode layers"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="every layer op by op (no C decode layers)"
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="engine threads (default: the usable cores)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="the tests need 641 tokens; a model's own context (128k for Llama 3) would not fit "
        "the default KV pool",
    )
    parser.add_argument("--reps", type=int, default=3, help="rounds")
    parser.add_argument("--peer", action="store_true", help="also run llama-bench on the same GGUF")
    parser.add_argument(
        "--record", default=None, metavar="DIR", help="write a run record under DIR/<topic>/"
    )
    args = parser.parse_args()
    print(f"CPU: {CpuFeatures.detect().describe()}")
    for model in args.model:
        record = measure(args, model)
        if record_dir(args.record):
            name = None if model is None else record_name(record, Path(model))
            write_record(record_dir(args.record), record, name=name)


if __name__ == "__main__":
    main()
