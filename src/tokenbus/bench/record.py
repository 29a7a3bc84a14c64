"""One JSON record per benchmark run, so the docs' tables come from measurements (L6).

A record lives at `<results dir>/<topic>/<name>.json` (the repository's is benchmarks/results/)
and says what ran, where, against which peers, and what came out:

    {"topic": "cpu_speed", "command": "...", "cpu": "...", "date": "...", "revision": "...",
     "source": "script", "variant": "", "peers": ["llama.cpp (llama-bench -t 2)"],
     "rows": {"tg128": {"tokenbus": 132.4, "llama.cpp": 89.01}}, "units": {"tg128": "tok/s"}}

`rows` maps a row label to its cells (column -> number or string); `units` names the unit of a
row or a column. benchmarks/results_tables.py renders docs/benchmarks.md from these files and
checks that the two agree.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from tokenbus.utils.cpu import CpuFeatures

RECORD_ENV = "TOKENBUS_BENCH_RECORD"  # a results dir, for scripts run without --record


def record_dir(explicit: str | None = None) -> str | None:
    """Where this run's record goes: --record DIR, else $TOKENBUS_BENCH_RECORD, else nowhere."""
    return explicit or os.environ.get(RECORD_ENV) or None


def cpu_summary() -> str:
    """The CPU's model name (with its family and model numbers, which tell generations apart
    where the name does not: "AMD EPYC"), its usable cores and the ISA tokenbus runs on."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']} model {fields['model']})"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return f"{model}, {cores} cores, {CpuFeatures.detect().describe()}"


def git_revision(repo: str | Path | None = None) -> str:
    """The checkout's short revision, with "+dirty" when tracked files differ from it."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", ":/src", ":/benchmarks"], cwd=cwd
        ).returncode
    except OSError:
        return "unknown"
    return (rev or "unknown") + ("+dirty" if rev and dirty else "")


# Settings that change what a benchmark measures; a record's command carries those that were set.
_COMMAND_ENV = (
    "TOKENBUS_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "GOMP_SPINCOUNT",
    "LLAMA_CPP_ISA",
    "VLLM_CPU_ISA",
)


def this_command(interpreter: bool = True) -> str:
    """This process's command line (interpreter first for a script), with the settings above."""
    cwd = Path.cwd()

    def short(arg: str) -> str:
        path = Path(arg)
        if path.is_absolute() and path.is_relative_to(cwd):
            return str(path.relative_to(cwd))
        return arg

    argv = [short(a) for a in sys.argv]
    if interpreter:
        argv.insert(0, short(sys.executable))
    env = [f"{k}={os.environ[k]}" for k in _COMMAND_ENV if os.environ.get(k)]
    return " ".join([*env, shlex.join(argv)])


def make_record(
    topic: str,
    command: str,
    rows: dict[str, dict[str, Any]],
    *,
    units: dict[str, str] | None = None,
    peers: list[str] | None = None,
    variant: str = "",
    cpu: str | None = None,
) -> dict[str, Any]:
    return {
        "topic": topic,
        "command": command,
        "cpu": cpu or cpu_summary(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "revision": git_revision(),
        "source": "script",
        "variant": variant,
        "peers": peers or [],
        "rows": rows,
        "units": units or {},
    }


def write_record(directory: str | Path, record: dict[str, Any], name: str | None = None) -> Path:
    """Write `record` as <directory>/<topic>/<name>.json (name: date and revision by default)."""
    if name is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        name = f"{stamp}-{record['revision']}"
    path = Path(directory) / record["topic"] / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"record: {path}")
    return path


def bench_result_rows(results: list) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Rows and units for `tokenbus bench throughput|prefix|structured`'s BenchResults: one row
    per engine, its rates and numeric extras, and on later rows the first's total rate over its."""
    first = results[0].total_tokens_per_s
    rows: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(results):
        cells: dict[str, Any] = {
            "req/s": round(r.requests_per_s, 2),
            "output": round(r.output_tokens_per_s, 1),
            "total": round(r.total_tokens_per_s, 1),
        }
        cells |= {k: round(v, 4) for k, v in r.extra.items() if isinstance(v, (int, float))}
        if i:
            cells["first / this"] = round(first / r.total_tokens_per_s, 2)
        rows[r.name] = cells
    return rows, {"output": "tok/s", "total": "tok/s", "first / this": "×"}


def serve_summary_rows(summary: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """One row for a `tokenbus bench serve` run: throughput and median latencies."""
    cells = {
        "requests": summary["completed"],
        "failed": summary["failed"],
        "output": round(summary["output_throughput"], 2),
        "total": round(summary["total_token_throughput"], 2),
        "TTFT p50": round(summary["median_ttft_ms"], 2),
        "ITL p50": round(summary["median_itl_ms"], 2),
    }
    units = {"output": "tok/s", "total": "tok/s", "TTFT p50": "ms", "ITL p50": "ms"}
    return {f"concurrency {summary['max_concurrency'] or 'unbounded'}": cells}, units
