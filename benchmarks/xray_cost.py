"""What an open /xray page costs a serving engine: c16 throughput with one viewer against none.

One `tokenbus serve` (the default model unless --model) is driven by `tokenbus bench serve` at
concurrency 16 on the peers' chat workload, alternately with no viewer and with one client
reading /xray/stream for the whole run (what the page does), --rounds times each, who goes
first alternating; the ratio is of the medians of total token throughput in the same run.

    .venv/bin/python benchmarks/xray_cost.py [--rounds 3] [--num-prompts 64] [--record DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from tokenbus.bench.server_wait import wait_healthy  # noqa: E402 - after the path

BIN = os.path.join(os.path.dirname(sys.executable), "tokenbus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=18411)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--record", default=None, metavar="DIR")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    tokenizer = tempfile.mkdtemp(prefix="tokenbus-tokenizer-")
    save_default_tokenizer(tokenizer)
    server = subprocess.Popen(
        [BIN, "serve", *([args.model] if args.model else []), "--port", str(args.port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(url)
        bench(url, tokenizer, args.num_prompts, "warm-up")
        rates: dict[str, list[float]] = {"no viewer": [], "one viewer": []}
        for round_index in range(args.rounds):
            # Who goes first alternates: a shared machine drifts within a round too.
            for watched in (False, True) if round_index % 2 == 0 else (True, False):
                if watched:
                    with Viewer(url) as viewer:
                        rate = bench(url, tokenizer, args.num_prompts, "one viewer")
                    print(f"  the viewer read {viewer.events} snapshots")
                    rates["one viewer"].append(rate)
                else:
                    rates["no viewer"].append(bench(url, tokenizer, args.num_prompts, "no viewer"))
    finally:
        server.terminate()
        server.wait(30)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["one viewer"] / medians["no viewer"]
    print(json.dumps({"rates": rates, "medians": medians, "ratio": ratio}, indent=1))
    if args.record:
        write_record(args, rates, medians, ratio)


def save_default_tokenizer(path: str) -> None:
    from transformers import AutoTokenizer

    from tokenbus.loader.source import packaged_smollm2_gguf

    gguf = packaged_smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)


def bench(url: str, tokenizer: str, num_prompts: int, label: str) -> float:
    """Total tokens/s of one c16 run (the peers scripts' workload)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [BIN, "bench", "serve", "--base-url", url, "--max-concurrency", "16",
             "--num-prompts", str(num_prompts), "--input-len", "20", "600", "--output-len", "16",
             "256", "--temperature", "0", "--ignore-eos", "--tokenizer", tokenizer,
             "--output-json", out.name],
            check=True,
            capture_output=True,
        )  # fmt: skip
        rate = json.load(open(out.name))["total_token_throughput"]
    print(f"{label}: {rate:.1f} total tok/s")
    return rate


class Viewer:
    """One /xray page's worth of reading: the event stream, consumed as it comes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        with httpx.stream("GET", self.url + "/xray/stream", timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events += 1
                if self._stop.is_set():
                    return

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def write_record(args, rates, medians, ratio) -> None:
    from tokenbus.bench.record import make_record, this_command, write_record

    rows = {
        "c16 total, median": {
            "no viewer": round(medians["no viewer"], 1),
            "one viewer": round(medians["one viewer"], 1),
            "one viewer / no viewer": round(ratio, 3),
        }
    }
    entry = make_record(
        "xray_cost",
        this_command(),
        rows,
        units={"c16 total, median": "tok/s"},
        peers=["the same server with no viewer, alternated"],
        variant=f"{args.rounds} rounds of {args.num_prompts} requests",
    )
    write_record(args.record, entry)


if __name__ == "__main__":
    main()
