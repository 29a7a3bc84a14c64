"""Write a run record from a shell benchmark's results in bench_out/.

    .venv/bin/python benchmarks/record_run.py serving DIR tokenbus llama_cpp vllm ...
    .venv/bin/python benchmarks/record_run.py cold_start DIR

Called by benchmarks/peers/serve_vs_llama_cpp.sh (tokenbus and every peer of the run, c1 and
c16, side by side) and benchmarks/cold_start.sh (each start, and the start-up memory line) when
$TOKENBUS_BENCH_RECORD names a results dir (record format: src/tokenbus/bench/record.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tokenbus.bench.record import make_record, write_record

OUT = Path("bench_out")
COLUMNS = {
    "tokenbus": "tokenbus",
    "llama_cpp": "llama.cpp",
    "llama_cpp_amx": "llama.cpp AMX",
    "vllm": "vLLM fp32",
    "vllm_bf16": "vLLM bf16",
}
RATIO_ROWS = ("c1 output", "c16 total")
UNITS = {
    "c1 output": "tok/s",
    "c1 ITL p50": "ms",
    "c1 TTFT p50": "ms",
    "c16 total": "tok/s",
    "c16 ITL p50": "ms",
    "cold start to healthy": "s",
}


def peer_description(name: str) -> str:
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
    llama = f"llama.cpp of llama-cpp-python {version}"
    if os.environ.get("LLAMA_CPP_ISA"):
        llama += f" built for {os.environ['LLAMA_CPP_ISA']}"
    vllm_cap = f", held to {os.environ['VLLM_CPU_ISA']}" if os.environ.get("VLLM_CPU_ISA") else ""
    return {
        "llama_cpp": f"{llama} (llama-server -t 2 -np 16)",
        "llama_cpp_amx": f"{llama} with AMX kernels (llama-server -t 2 -np 16)",
        "vllm": f"vLLM CPU, fp32{vllm_cap}",
        "vllm_bf16": f"vLLM CPU, bf16{vllm_cap}",
    }[name]


def engine_figures(name: str) -> dict[str, float]:
    c1 = json.loads((OUT / f"peer_{name}_c1.json").read_text())
    c16 = json.loads((OUT / f"peer_{name}_c16.json").read_text())
    start = (OUT / f"peer_{name}_start.txt").read_text().split(":")[-1].split()[0]
    return {
        "c1 output": round(c1["output_throughput"], 2),
        "c1 ITL p50": round(c1["median_itl_ms"], 2),
        "c1 TTFT p50": round(c1["median_ttft_ms"], 1),
        "c16 total": round(c16["total_token_throughput"], 2),
        "c16 ITL p50": round(c16["median_itl_ms"], 2),
        "cold start to healthy": round(float(start), 2),
    }


def serving(directory: str, names: list[str]) -> None:
    names = [n for n in names if n != "none"]
    figures = {COLUMNS[n]: engine_figures(n) for n in names}
    rows: dict[str, dict] = {label: {} for label in UNITS}
    for column, values in figures.items():
        for label, value in values.items():
            rows[label][column] = value
    for label in RATIO_ROWS:
        ours = figures["tokenbus"][label]
        for column in list(figures)[1:]:
            rows[label][f"tokenbus / {column}"] = round(ours / figures[column][label], 2)
    command = shell_command(
        "benchmarks/peers/serve_vs_llama_cpp.sh", ("PEERS", "SERVE_ARGS", "MODEL")
    )
    model = os.environ.get("MODEL", "")
    units = UNITS | {f"tokenbus / {c}": "×" for c in list(figures)[1:]}
    record = make_record(
        "serving",
        command,
        rows,
        units=units,
        peers=[peer_description(n) for n in names if n != "tokenbus"],
        # Another model's figures are a setting of their own, beside the default model's.
        variant=" ".join(
            filter(None, [Path(model).name if model else "", os.environ.get("SERVE_ARGS", "")])
        ).strip(),
    )
    write_record(directory, record)


def cold_start(directory: str) -> None:
    """bench_out/cold_start_runs.txt's lines ("run 1, tokenbus: healthy after 2.15 s")."""
    starts: dict[str, list[str]] = {}
    for line in (OUT / "cold_start_runs.txt").read_text().splitlines():
        server = line.split(", ", 1)[1].split(":")[0].split(" (")[0]
        starts.setdefault(server, []).append(f"{float(line.split()[-2]):.2f}")
    cells = {
        {"tokenbus": "tokenbus", "llama_cpp": "llama-server"}[k]: ", ".join(v)
        for k, v in starts.items()
    }
    memory = (OUT / "cold_start.log").read_text().split("peak RSS")
    if len(memory) > 1:
        cells["peak RSS"] = float(memory[-1].split()[0])
    peers = [peer_description("llama_cpp")] if "llama_cpp" in starts else []
    dropped = "page cache dropped" if os.environ.get("DROP_CACHES") == "1" else ""
    record = make_record(
        "cold_start",
        shell_command("benchmarks/cold_start.sh", ("DROP_CACHES", "PEER", "RUNS")),
        {"": cells},
        units={"tokenbus": "s", "llama-server": "s", "peak RSS": "MiB"},
        peers=peers,
        variant=dropped,
    )
    write_record(directory, record)


def shell_command(script: str, settings: tuple[str, ...]) -> str:
    """The script's command line as run: the ISA caps and its own settings that were set."""
    names = (
        "TOKENBUS_CPU_ISA",
        "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA",
        "MKL_ENABLE_INSTRUCTIONS",
        "LLAMA_CPP_ISA",
        "VLLM_CPU_ISA",
        *settings,
    )
    env = [f'{k}="{os.environ[k]}"' if " " in os.environ[k] else f"{k}={os.environ[k]}"
           for k in names if os.environ.get(k)]  # fmt: skip
    return " ".join([*env, f"bash {script}"])


if __name__ == "__main__":
    {
        "serving": lambda: serving(sys.argv[2], sys.argv[3:]),
        "cold_start": lambda: cold_start(sys.argv[2]),
    }[sys.argv[1]]()
