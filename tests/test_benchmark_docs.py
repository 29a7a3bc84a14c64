"""docs/benchmarks.md's tables are the run records under benchmarks/results/, rendered."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tokenbus.bench.record import bench_result_rows, make_record, write_record
from tokenbus.bench.report import BenchResult

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load("results_tables")


def test_doc_matches_the_records():
    doc = tables.DOC.read_text()
    assert tables.render_doc(doc, tables.load_records()) == doc, (
        "docs/benchmarks.md differs from benchmarks/results/: "
        "run .venv/bin/python benchmarks/results_tables.py"
    )


def test_every_record_is_complete():
    keys = {"topic", "command", "cpu", "date", "revision", "source", "peers", "rows", "units"}
    for records in tables.load_records().values():
        for record in records:
            assert keys <= set(record), record["command"]
            assert record["rows"] and all(isinstance(c, dict) for c in record["rows"].values())


def test_newest_record_per_cpu_and_variant_shows(tmp_path):
    def record(cpu, date, value, variant=""):
        r = make_record("speed", "cmd", {"tg128": {"tokenbus": value}}, cpu=cpu, variant=variant)
        return r | {"date": date}

    old, new = record("cpu A", "2026-01-01", 1.0), record("cpu A", "2026-02-01", 2.0)
    other, capped = record("cpu B", "2026-01-01", 3.0), record("cpu A", "2026-01-01", 4.0, "x")
    for i, r in enumerate([new, old, other, capped]):
        write_record(tmp_path, r, name=f"r{i}")
    shown = tables.current(tables.load_records(tmp_path)["speed"])
    assert [r["rows"]["tg128"]["tokenbus"] for r in shown] == [2.0, 4.0, 3.0]


def test_a_section_is_filled_and_checked(tmp_path):
    record = make_record(
        "speed",
        "python bench.py",
        {"tg128": {"tokenbus": 132.4, "llama.cpp": "89.01 ± 1.34", "tokenbus / llama.cpp": 1.49}},
        units={"tg128": "tok/s", "tokenbus / llama.cpp": "×"},
        peers=["llama.cpp"],
        cpu="Some CPU, 2 cores",
    )
    write_record(tmp_path, record, name="run")
    doc = "# B\n<!-- results:speed -->\nstale\n<!-- /results:speed -->\n"
    out = tables.render_doc(doc, tables.load_records(tmp_path))
    assert "| Some CPU, 2 cores | tg128 (tok/s) | 132.4 | 89.01 ± 1.34 | 1.49× | 1 |" in out
    assert "peers in the same run: llama.cpp" in out and "stale" not in out
    assert tables.render_doc(out, tables.load_records(tmp_path)) == out


def test_records_without_a_section_are_an_error(tmp_path):
    write_record(tmp_path, make_record("orphan", "cmd", {"": {"x": 1}}, cpu="c"), name="r")
    try:
        tables.render_doc("# B\n", tables.load_records(tmp_path))
    except ValueError as exc:
        assert "orphan" in str(exc)
    else:
        raise AssertionError("a record without a section rendered")


def test_bench_results_become_rows():
    results = [BenchResult("tokenbus", 8, 2.0, 600, 200), BenchResult("hf", 8, 8.0, 600, 200)]
    rows, units = bench_result_rows(results)
    assert rows["tokenbus"]["total"] == 400.0 and "first / this" not in rows["tokenbus"]
    assert rows["hf"]["first / this"] == 4.0 and units["first / this"] == "×"


def test_cpu_speed_reads_llama_bench(tmp_path):
    cpu_speed = _load("cpu_speed")
    peer = json.dumps([
        {"build_commit": "0c1e570", "n_prompt": 512, "n_gen": 0, "avg_ts": 362.0},
        {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 128, "avg_ts": 103.0},
    ])  # fmt: skip
    rates, commit = cpu_speed.parse_llama_bench(peer)
    assert rates == {"pp512": 362.0, "tg128": 103.0} and commit == "0c1e570"
    args = cpu_speed.argparse.Namespace(
        quantization="auto", dtype="auto", quant_activations="int8", enforce_eager=False,
        num_threads=None, reps=3, attention_backend="auto",
    )  # fmt: skip
    record = cpu_speed.speed_record(args, None, {"tg128": 143.2, "pp512": 1011.0}, rates, commit)
    assert record["topic"] == "cpu_speed"
    assert record["rows"]["tg128"] == {
        "tokenbus": 143.2,
        "llama.cpp": 103.0,
        "tokenbus / llama.cpp": 1.39,
    }
    assert record["rows"]["pp512"]["tokenbus / llama.cpp"] == 2.79
    assert record["variant"] == "--quant-activations int8"
    assert record["peers"][0].startswith("llama.cpp 0c1e570 (llama-bench -t 2 -r 1 per round")
    json.dumps(record)  # a record is plain JSON


def test_cpu_speed_records_a_refused_file_beside_llama_cpp(tmp_path):
    cpu_speed = _load("cpu_speed")
    gguf = tmp_path / "random-llama-3.2-1b-IQ4_XS.gguf"
    gguf.write_bytes(b"\0" * 2**20)
    error = ValueError(
        f"{gguf}: tensor blk.0.ffn_down.weight has unsupported type IQ4_XS (supported: F32, F16)"
    )
    refused = cpu_speed.refusal(error)
    assert refused == "refused: tensor blk.0.ffn_down.weight has unsupported type IQ4_XS"
    args = cpu_speed.argparse.Namespace(
        quantization="auto", dtype="auto", quant_activations="auto", enforce_eager=False,
        num_threads=None, reps=3, attention_backend="auto",
    )  # fmt: skip
    record = cpu_speed.speed_record(args, str(gguf), refused, {"tg128": 20.1, "pp512": 150.0})
    assert record["topic"] == "gguf_speed"
    assert record["variant"] == "random-llama-3.2-1b-IQ4_XS.gguf (0.00 GiB)"
    day = record["date"][:10]
    assert cpu_speed.record_name(record, gguf) == f"{day}-random-llama-3.2-1b-IQ4_XS"
    eager = dict(record, variant=record["variant"] + " --enforce-eager --num-threads 1")
    assert cpu_speed.record_name(eager, gguf).endswith("-IQ4_XS-enforce-eager-num-threads-1")
    assert record["rows"]["tg128"] == {"tokenbus": refused, "llama.cpp": 20.1}


def test_gpu_check_figures_become_gpu_tables(tmp_path):
    """figures.json from benchmarks/gpu_check.sh: one record per GPU topic, headed by the GPU
    and the stack it ran, the HF peer named with its batch sizes."""
    record_run = _load("record_run")
    versions = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "triton": "3.6.0"}
    part = {"device": "NVIDIA H200", "versions": versions}
    serve = {"completed": 16, "failed": 0, "output_throughput": 91.4, "median_ttft_ms": 40.2,
             "median_itl_ms": 10.9, "p99_itl_ms": 12.4,
             "total_token_throughput": 400.0}  # fmt: skip
    figures = {
        "attention_backend": "auto",
        "decode_8b": part | {"part": "decode", "decode_tokens_per_s": 240.0,
                             "bound_tokens_per_s": 268.0, "fraction_of_bound": 0.8956,
                             "weight_bytes": 16.06e9, "bandwidth_bytes_per_s": 4.3e12,
                             "decode_tokens_per_s_async": 252.0,
                             "fraction_of_bound_async": 0.9403},
        "throughput_8b": part | {"part": "throughput", "tokenbus_total_tokens_per_s": 30000.0,
                                 "hf_total_tokens_per_s_by_batch": {"128": 4000.0, "256": 5000.0},
                                 "hf_best_batch_size": 256, "ratio_vs_hf_best": 6.0},
        "serve_c64": serve | {"max_concurrency": 64},
        "serve_c1": serve | {"max_concurrency": 1},
        "graphs_smollm2": part | {"part": "graphs", "graphs_over_eager": {"1": 3.1},
                                  "decode_tokens_per_s": {"eager": {"1": 200.0},
                                                          "graphs": {"1": 620.0}}},
    }  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    (out / "figures.json").write_text(json.dumps(figures))
    record_run.gpu_check(str(out), str(tmp_path / "results"))
    by_topic = tables.load_records(tmp_path / "results")
    assert sorted(by_topic) == ["gpu_decode", "gpu_graphs", "gpu_serving", "gpu_throughput"]
    serving = by_topic["gpu_serving"][0]
    assert list(serving["rows"]) == ["concurrency 1", "concurrency 64"]
    assert serving["cpu"].startswith("NVIDIA H200 (torch 2.11.0+cu130, transformers 5.17.0")
    doc = "".join(f"<!-- results:{t} -->\n<!-- /results:{t} -->\n" for t in sorted(by_topic))
    rendered = tables.render_doc(doc, by_topic)
    assert "| GPU |  | tokenbus (tok/s) | memory bound (tok/s) | weights (GB)" in rendered
    assert "| 0.896× |" in rendered and "| 6.0× |" in rendered and "| 3.1× |" in rendered
    assert "one stream, --async-scheduling | 252.0 | 268.0 |" in rendered
    assert "| 0.94× |" in rendered
    assert "HF transformers 5.17.0 generate, static batches of 128, 256, best shown" in rendered


def test_decode_bound_counts_the_bytes_a_token_reads():
    """gpu_bench's memory bound: every weight of a dense model but the embedding; for an MoE,
    each layer's router and top k experts only (Qwen3-30B-A3B: ~3B of its 30B)."""
    bench = _load("gpu_bench")
    configs = ROOT / "benchmarks" / "configs"
    llama = bench.weight_bytes(str(configs / "llama-3.1-8b"), "bfloat16")
    # Llama-3.1-8B has 8,030,261,248 parameters: less its embedding and its 65 norms
    assert llama == 2 * (8_030_261_248 - 128_256 * 4096 - 65 * 4096)
    moe = bench.weight_bytes(str(configs / "qwen3-30b-a3b"), "bfloat16")
    assert 2.9e9 < moe / 2 < 3.2e9
