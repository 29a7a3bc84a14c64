"""Write a run record from a shell benchmark's results in bench_out/.

    .venv/bin/python benchmarks/record_run.py serving DIR tokenbus llama_cpp vllm ...
    .venv/bin/python benchmarks/record_run.py cold_start DIR
    .venv/bin/python benchmarks/record_run.py gpu_check OUT_DIR benchmarks/results

Called by benchmarks/peers/serve_vs_llama_cpp.sh (tokenbus and every peer of the run, c1 and
c16, side by side) and benchmarks/cold_start.sh (each start, and the start-up memory line) when
$TOKENBUS_BENCH_RECORD names a results dir (record format: src/tokenbus/bench/record.py); by
hand for benchmarks/gpu_check.sh, whose figures.json comes back from the GPU machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tokenbus.bench.record import make_record, serve_summary_rows, write_record

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


def gpu_check(directory: str, results: str) -> None:
    """benchmarks/gpu_check.sh's figures.json (in `directory`, the $OUT it wrote): one record
    per GPU topic, each naming the GPU as the CPU tables name their CPU."""
    figures = json.loads((Path(directory) / "figures.json").read_text())
    parts = [v for v in figures.values() if isinstance(v, dict) and "part" in v]
    gpu = next(p["device"] for p in parts if p.get("device"))
    versions = next((p["versions"] for p in parts if p.get("versions")), {})
    stack = ", ".join(f"{name} {version}" for name, version in versions.items())
    gpu += f" ({stack}; attention {figures.get('attention_backend', 'auto')})"
    command = shell_command("benchmarks/gpu_check.sh", ("DEADLINE",))
    for topic, (rows, units, peers) in gpu_rows(figures).items():
        if rows:
            record = make_record(topic, command, rows, units=units, peers=peers, cpu=gpu)
            write_record(results, record)


def gpu_rows(figures: dict) -> dict[str, tuple[dict, dict, list[str]]]:
    """Per GPU topic: rows, units and the peers of the same run, from what the run measured."""
    topics: dict[str, tuple[dict, dict, list[str]]] = {}
    if decode := figures.get("decode_8b"):
        rows = {
            "Llama-3.1-8B shape, bf16, one stream": {
                "tokenbus": round(decode["decode_tokens_per_s"], 1),
                "memory bound": round(decode["bound_tokens_per_s"], 1),
                "tokenbus / bound": round(decode["fraction_of_bound"], 3),
                "weights": round(decode["weight_bytes"] / 1e9, 2),
                "copy bandwidth": round(decode["bandwidth_bytes_per_s"] / 1e12, 2),
            }
        }
        if "decode_tokens_per_s_async" in decode:
            rows["Llama-3.1-8B shape, bf16, one stream, --async-scheduling"] = {
                "tokenbus": round(decode["decode_tokens_per_s_async"], 1),
                "memory bound": round(decode["bound_tokens_per_s"], 1),
                "tokenbus / bound": round(decode["fraction_of_bound_async"], 3),
            }
        units = {"tokenbus": "tok/s", "memory bound": "tok/s", "tokenbus / bound": "×"}
        units |= {"weights": "GB", "copy bandwidth": "TB/s"}
        topics["gpu_decode"] = (rows, units, ["the bound: weight bytes / measured copy bandwidth"])
    if (throughput := figures.get("throughput_8b")) and "hf_best_batch_size" in throughput:
        best = throughput["hf_best_batch_size"]
        hf = throughput["hf_total_tokens_per_s_by_batch"][str(best)]
        rows = {
            "Llama-3.1-8B shape, bf16, 256 prompts × (512 in + 256 out)": {
                "tokenbus": round(throughput["tokenbus_total_tokens_per_s"], 1),
                f"HF generate (batch {best})": round(hf, 1),
                "tokenbus / HF": round(throughput["ratio_vs_hf_best"], 2),
            }
        }
        units = {"tokenbus": "tok/s", f"HF generate (batch {best})": "tok/s", "tokenbus / HF": "×"}
        version = throughput.get("versions", {}).get("transformers", "")
        sizes = ", ".join(throughput["hf_total_tokens_per_s_by_batch"])
        peers = [f"HF transformers {version} generate, static batches of {sizes}, best shown"]
        topics["gpu_throughput"] = (rows, units, peers)
    serve_rows: dict[str, dict] = {}
    units = {"ITL p99": "ms"}
    for name in sorted((k for k in figures if k.startswith("serve_c")), key=lambda k: int(k[7:])):
        rows, serve_units = serve_summary_rows(figures[name])
        for cells in rows.values():
            cells["ITL p99"] = round(figures[name]["p99_itl_ms"], 2)
        serve_rows |= rows
        units |= serve_units
    topics["gpu_serving"] = (serve_rows, units, [])
    graph_rows = {}
    for name, label in (("graphs_smollm2", "SmolLM2-135M shape"), ("graphs_8b", "8B shape")):
        graphs = figures.get(name)
        for batch, ratio in (graphs or {}).get("graphs_over_eager", {}).items():
            rates = graphs["decode_tokens_per_s"]
            graph_rows[f"{label}, batch {batch}"] = {
                "eager": round(rates["eager"][batch], 1),
                "CUDA graphs": round(rates["graphs"][batch], 1),
                "graphs / eager": round(ratio, 2),
            }
    units = {"eager": "tok/s", "CUDA graphs": "tok/s", "graphs / eager": "×"}
    topics["gpu_graphs"] = (graph_rows, units, ["the same engine with --enforce-eager"])
    return topics


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
        "gpu_check": lambda: gpu_check(sys.argv[2], sys.argv[3]),
    }[sys.argv[1]]()
