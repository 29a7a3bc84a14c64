"""The persistent KV tier after a restart: TTFT of a chat whose 1,500-token system prompt was
served before the server went down, cold vs warm from the OffloadingConnector's disk tier.

Per trial (a different system prompt each, so nothing is warm by accident):
  1. `tokenbus serve` with no connector:       TTFT of the chat (the baseline, a plain server)
  2. `tokenbus serve` + OffloadingConnector, on an empty disk tier: TTFT cold (it saves)
  3. stop it (SIGTERM: the tier flushes), start it again on the same directory,
     another question under the same system prompt: TTFT warm (the prompt's blocks from disk);
     the tier's load throughput from /metrics (bytes loaded / seconds loading); then a third
     question: TTFT with the prefix already in the pool (all of the TTFT but the load)
  4. the page cache's own speed: every file of the tier read into one reused buffer (best of
     3 passes), the ceiling of the tier's load throughput

Every request streams one token (max_tokens 1), temperature 0. Prints one line per trial and
the medians; --output-json writes them. Run from the repo root (the default model).

    .venv/bin/python benchmarks/kv_tier_restart.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenbus.bench.record import make_record, record_dir, this_command, write_record

WORDS = (
    "river stone market lantern harvest signal quiet copper meadow circuit orbit ledger "
    "thunder velvet garden compass mirror anchor timber canyon beacon ember falcon glacier "
    "harbor island jungle kettle lemon marble needle ocean pepper quartz rocket saddle "
    "tunnel umbrella valley wander yonder zephyr archive bridge candle desert engine"
).split()


def system_prompt(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_words // 12):
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return "You are a careful assistant. Reference notes follow.\n" + " ".join(sentences)


class Server:
    def __init__(self, port: int, extra: list[str], log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenbus", "serve", "--port", str(port), *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server on {port} never became healthy; see {log}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def kv_loaded(self) -> tuple[int, float]:
        """(bytes, seconds) the KV connector spent loading, from /metrics."""
        totals = {"loaded_bytes_total": 0.0, "load_seconds_total": 0.0}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            for key in totals:
                if name.startswith("tokenbus:kv_transfer_" + key):
                    totals[key] += float(value)
        return int(totals["loaded_bytes_total"]), totals["load_seconds_total"]

    def num_tokens(self, text: str) -> int:
        return httpx.post(self.url + "/tokenize", json={"prompt": text}, timeout=60).json()["count"]

    def ttft(self, system: str, question: str) -> tuple[float, int]:
        """Seconds to the first streamed token, and the prompt tokens the server reported cached."""
        body = {
            "model": "default",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        models = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
        body["model"] = models[0]["id"]
        start = time.perf_counter()
        first, cached = None, 0
        with httpx.stream(
            "POST", self.url + "/v1/chat/completions", json=body, timeout=300
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(
                    c.get("delta", {}).get("content") for c in chunk.get("choices", [])
                ):
                    first = time.perf_counter() - start
                usage = chunk.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        if first is None:
            raise RuntimeError("no token streamed")
        return first, cached


def page_cache_gbps(directory: str, passes: int = 3) -> float:
    """GB/s of reading every file under `directory` (in the page cache: just written and read)
    into one reused buffer, the best of `passes`."""
    paths = [p for p in Path(directory).rglob("*") if p.is_file()]
    buffer = bytearray(max(p.stat().st_size for p in paths))
    best = 0.0
    for _ in range(passes):
        started, num_bytes = time.perf_counter(), 0
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                num_bytes += f.readinto(buffer)
        best = max(best, num_bytes / (time.perf_counter() - started) / 1e9)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--port", type=int, default=8061)
    parser.add_argument(
        "--system-words", type=int, default=1250, help="about 1.2 tokens per word: ~1,500 tokens"
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--log", default="bench_out/kv_tier_restart.log")
    parser.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="write a run record under DIR/kv_tier_restart/",
    )
    ns = parser.parse_args()
    Path(ns.log).parent.mkdir(parents=True, exist_ok=True)
    common = ["--enable-prompt-tokens-details"]
    rows = []
    for trial in range(ns.trials):
        system = system_prompt(1000 + trial, ns.system_words)
        plain = Server(ns.port, common, Path(ns.log))
        num_tokens = plain.num_tokens(system)
        baseline, _ = plain.ttft(system, "Summarise the notes in one line.")
        plain.stop()
        with tempfile.TemporaryDirectory(prefix="kv-tier-") as tier:
            config = json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"disk_path": tier},
                }
            )
            server = Server(ns.port, [*common, "--kv-transfer-config", config], Path(ns.log))
            cold, cold_cached = server.ttft(system, "Summarise the notes in one line.")
            server.stop()
            server = Server(ns.port, [*common, "--kv-transfer-config", config], Path(ns.log))
            warm, warm_cached = server.ttft(system, "Which word appears most often?")
            loaded_bytes, load_s = server.kv_loaded()
            in_pool, _ = server.ttft(system, "Which word appears least often?")
            server.stop()
            ceiling = page_cache_gbps(tier)
        row = dict(
            trial=trial,
            system_tokens=num_tokens,
            no_connector_s=baseline,
            cold_s=cold,
            warm_s=warm,
            cold_cached_tokens=cold_cached,
            warm_cached_tokens=warm_cached,
            in_pool_s=in_pool,
            loaded_bytes=loaded_bytes,
            load_s=load_s,
            load_gbps=loaded_bytes / load_s / 1e9 if load_s else 0.0,
            page_cache_gbps=ceiling,
            speedup=cold / warm,
            load_average=os.getloadavg()[0],  # others on the cores inflate every figure
        )
        rows.append(row)
        print(
            f"trial {trial}: system prompt {num_tokens} tokens; "
            f"TTFT no connector {baseline * 1e3:.0f} ms, "
            f"cold {cold * 1e3:.0f} ms (cached {cold_cached}), after restart {warm * 1e3:.0f} ms "
            f"(cached {warm_cached}): {cold / warm:.1f}x; "
            f"prefix in the pool {in_pool * 1e3:.0f} ms; "
            f"tier load {loaded_bytes / 1e6:.1f} MB in {load_s * 1e3:.1f} ms = "
            f"{row['load_gbps']:.2f} GB/s (page cache {ceiling:.2f} GB/s)",
            flush=True,
        )
    summary = {
        key: statistics.median(r[key] for r in rows)
        for key in (
            "no_connector_s",
            "cold_s",
            "warm_s",
            "in_pool_s",
            "load_s",
            "load_gbps",
            "page_cache_gbps",
        )
    }
    summary["speedup_median"] = summary["cold_s"] / summary["warm_s"]
    print(
        f"median TTFT: no connector {summary['no_connector_s'] * 1e3:.0f} ms, "
        f"cold {summary['cold_s'] * 1e3:.0f} ms, "
        f"warm after restart {summary['warm_s'] * 1e3:.0f} ms: {summary['speedup_median']:.1f}x; "
        f"prefix in the pool {summary['in_pool_s'] * 1e3:.0f} ms; tier load "
        f"{summary['load_s'] * 1e3:.1f} ms, {summary['load_gbps']:.2f} GB/s "
        f"(page cache {summary['page_cache_gbps']:.2f} GB/s)"
    )
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"trials": rows, "summary": summary}, indent=2))
    if record_dir(ns.record):
        write_record(record_dir(ns.record), restart_record(rows, summary))
    return 0


def restart_record(trials: list[dict], summary: dict) -> dict:
    """Each trial's TTFTs (ms) and the median as a run record."""
    rows = {}
    for t in trials:
        rows[f"trial {t['trial']}"] = {
            "system prompt tokens": t["system_tokens"],
            "TTFT, no connector": round(t["no_connector_s"] * 1e3),
            "TTFT, cold": round(t["cold_s"] * 1e3),
            "TTFT, warm after restart": round(t["warm_s"] * 1e3),
            "cached tokens (warm)": t["warm_cached_tokens"],
            "TTFT, prefix in the pool": round(t["in_pool_s"] * 1e3),
            "KV loaded": round(t["loaded_bytes"] / 1e6, 1),
            "tier load": round(t["load_s"] * 1e3, 1),
            "tier load throughput": round(t["load_gbps"], 2),
            "page-cache read": round(t["page_cache_gbps"], 2),
            "machine load (1 min)": round(t["load_average"], 1),
            "cold / warm": round(t["speedup"], 1),
        }
    rows["median"] = {
        "TTFT, no connector": round(summary["no_connector_s"] * 1e3),
        "TTFT, cold": round(summary["cold_s"] * 1e3),
        "TTFT, warm after restart": round(summary["warm_s"] * 1e3),
        "TTFT, prefix in the pool": round(summary["in_pool_s"] * 1e3),
        "tier load": round(summary["load_s"] * 1e3, 1),
        "tier load throughput": round(summary["load_gbps"], 2),
        "page-cache read": round(summary["page_cache_gbps"], 2),
        "cold / warm": round(summary["speedup_median"], 1),
    }
    units = {
        "TTFT, no connector": "ms",
        "TTFT, cold": "ms",
        "TTFT, warm after restart": "ms",
        "TTFT, prefix in the pool": "ms",
        "KV loaded": "MB",
        "tier load": "ms",
        "tier load throughput": "GB/s",
        "page-cache read": "GB/s",
        "cold / warm": "×",
    }
    peers = ["tokenbus serve without a connector"]
    return make_record("kv_tier_restart", this_command(), rows, units=units, peers=peers)


if __name__ == "__main__":
    sys.exit(main())
