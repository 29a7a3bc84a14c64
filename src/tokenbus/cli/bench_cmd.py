"""`tokenbus bench throughput | prefix | structured | serve | plot` (L7)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tokenbus.cli.args import add_engine_args, engine_args_from


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers()

    tp = kinds.add_parser("throughput", help="offline throughput on a seeded synthetic workload")
    add_engine_args(tp)
    _add_workload_args(tp)
    tp.add_argument(
        "--compare",
        choices=["hf"],
        action="append",
        default=[],
        help="also run a peer on the same workload in the same run",
    )
    tp.add_argument("--hf-batch-size", type=int, default=16)
    tp.add_argument("--output-json", default=None)
    _add_plot_arg(tp)
    _add_record_arg(tp)
    tp.set_defaults(func=_throughput)

    px = kinds.add_parser("prefix", help="shared-prefix workload: prefix caching on vs off")
    add_engine_args(px)
    px.add_argument("--num-prompts", type=int, default=64)
    px.add_argument("--prefix-len", type=int, default=1500)
    px.add_argument("--question-len", type=int, default=20)
    px.add_argument("--output-len", type=int, default=16)
    px.add_argument("--dataset-seed", type=int, default=0)
    px.add_argument("--output-json", default=None)
    _add_plot_arg(px)
    _add_record_arg(px)
    px.set_defaults(func=_prefix)

    _add_structured_parser(kinds)

    _add_serve_parser(kinds)
    _add_plot_parser(kinds)


def _add_structured_parser(kinds) -> None:
    st = kinds.add_parser("structured", help="constrained (JSON schema) vs unconstrained batch")
    add_engine_args(st)
    st.add_argument("--num-prompts", type=int, default=32)
    st.add_argument("--max-tokens", type=int, default=96)
    st.add_argument("--output-json", default=None)
    _add_plot_arg(st)
    _add_record_arg(st)
    st.set_defaults(func=_structured)


def _structured(ns: argparse.Namespace) -> int:
    from tokenbus.bench.report import print_table
    from tokenbus.bench.structured import run_structured_bench

    results = run_structured_bench(engine_args_from(ns), ns.num_prompts, ns.max_tokens)
    print_table(results)
    _write_json(ns.output_json, [r.to_dict() for r in results])
    _plot_results(ns.plot, results, "constrained vs unconstrained")
    _record_results(ns, "structured_output", results, peers=["the same prompts unconstrained"])
    return 0


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[20, 600], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX")
    )
    parser.add_argument("--dataset-seed", type=int, default=0)


def _throughput(ns: argparse.Namespace) -> int:
    from tokenbus.bench.datasets import random_workload
    from tokenbus.bench.report import print_table
    from tokenbus.bench.throughput import run_hf_throughput, run_tokenbus_throughput
    from tokenbus.loader import load_arch, resolve_model

    args = engine_args_from(ns)
    vocab_size = load_arch(resolve_model(args.model)).vocab_size
    workload = random_workload(
        ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), ns.dataset_seed, vocab_size
    )
    results = [run_tokenbus_throughput(args, workload)]
    if "hf" in ns.compare:
        results.append(run_hf_throughput(args, workload, ns.hf_batch_size))
    print_table(results)
    _write_json(ns.output_json, [r.to_dict() for r in results])
    _plot_results(ns.plot, results, f"offline throughput, {ns.num_prompts} requests")
    variant = f"{ns.num_prompts} requests, {args.dtype}"
    if args.quantization != "auto":  # runs of one workload with other weights keep their rows
        variant += f", quantization {args.quantization}"
    _record_results(
        ns, "throughput_hf", results, variant, ["HF transformers"] * ("hf" in ns.compare)
    )
    return 0


def _prefix(ns: argparse.Namespace) -> int:
    from tokenbus.bench.prefix import run_prefix_bench
    from tokenbus.bench.report import print_table

    results = run_prefix_bench(
        engine_args_from(ns),
        ns.num_prompts,
        ns.prefix_len,
        ns.question_len,
        ns.output_len,
        ns.dataset_seed,
    )
    print_table(results)
    _write_json(ns.output_json, [r.to_dict() for r in results])
    _plot_results(ns.plot, results, "shared-prefix workload")
    _record_results(ns, "prefix_caching", results, peers=["the same engine, caching off"])
    return 0


def _write_json(path: str | None, payload) -> None:
    """Write `payload` to `path` as indented JSON; no path, no file."""
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def _add_plot_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="also draw the results (needs matplotlib)"
    )


def _plot_results(path: str | None, results, title: str) -> None:
    """Bars of total and output tokens/s per engine, with each one's ratio to the first."""
    if path:
        from tokenbus.bench.plot import plot_bars

        values = {
            "total tokens/s": [r.total_tokens_per_s for r in results],
            "output tokens/s": [r.output_tokens_per_s for r in results],
        }
        plot_bars([r.name for r in results], values, path, title)
        print(f"plot: {path}")


def _add_record_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="also write a run record under DIR/<topic>/ (docs/benchmarks.md's tables); "
        "default: $TOKENBUS_BENCH_RECORD",
    )


def _record_results(ns, topic: str, results, variant: str = "", peers=()) -> None:
    from tokenbus.bench import record

    directory = record.record_dir(ns.record)
    if directory:
        rows, units = record.bench_result_rows(results)
        command = record.this_command(interpreter=False)
        entry = record.make_record(topic, command, rows, units=units, peers=list(peers))
        record.write_record(directory, entry | {"variant": variant})


def _add_serve_parser(kinds) -> None:
    sv = kinds.add_parser(
        "serve",
        help="online load against a running OpenAI-compatible server "
        "(ours or a peer's), vLLM's 'bench serve' table",
    )
    sv.add_argument("--base-url", default="http://127.0.0.1:8000", help="loopback servers only")
    sv.add_argument("--endpoint", default="/v1/completions")
    sv.add_argument("--model", default=None, help="default: the first model the server lists")
    sv.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"))
    _add_workload_args(sv)
    sv.add_argument(
        "--dataset-path",
        default=None,
        help='JSONL of {"prompt": str | [ids], "output_len": int} instead of random prompts',
    )
    sv.add_argument(
        "--tokenizer",
        default=None,
        help="send text (decoded with this HF tokenizer) instead of token ids",
    )
    sv.add_argument(
        "--vocab-size", type=int, default=49152, help="random token ids stay below this"
    )
    sv.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s (Poisson); inf: all at once",
    )
    sv.add_argument("--burstiness", type=float, default=1.0)
    sv.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="in-flight cap; several values run one benchmark per value, in order",
    )
    sv.add_argument("--ignore-eos", action="store_true", help="force exact output lengths")
    sv.add_argument("--temperature", type=float, default=0.0)
    sv.add_argument("--request-timeout", type=float, default=600.0)
    sv.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    sv.add_argument(
        "--output-json",
        default=None,
        help="the summary; with several --max-concurrency values, {'runs': [one each]}",
    )
    sv.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="throughput, TTFT and ITL against concurrency (needs matplotlib)",
    )
    sv.add_argument("--label", default=None, help="the engine's name in the plot")
    sv.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="also write a run record under DIR/serve_client/",
    )
    sv.set_defaults(func=_serve_bench)


def _serve_bench(ns: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from tokenbus.bench import serve

    percentiles = tuple(float(p) for p in ns.metric_percentiles.split(","))
    base = serve.ServeBenchConfig(
        base_url=ns.base_url,
        endpoint=ns.endpoint,
        model=ns.model,
        api_key=ns.api_key,
        request_rate=ns.request_rate,
        burstiness=ns.burstiness,
        seed=ns.dataset_seed,
        ignore_eos=ns.ignore_eos,
        temperature=ns.temperature,
        request_timeout_s=ns.request_timeout,
        percentiles=tuple(sorted({50.0, *percentiles})),
    )
    requests = _serve_requests(ns, serve)
    runs = []
    for cap in ns.max_concurrency or [None]:
        config = dataclasses.replace(base, max_concurrency=cap)
        try:
            summary = asyncio.run(serve.run_benchmark(config, requests))
        except (RuntimeError, OSError) as exc:  # unreachable, or it refused the test request
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(serve.format_report(summary, percentiles))
        runs.append({"config": serve.config_dict(config), **summary})
        _record_serve(ns, summary)
    _write_json(ns.output_json, runs[0] if len(runs) == 1 else {"runs": runs})
    if ns.plot:
        from tokenbus.bench.plot import Series, plot_serve

        plot_serve([Series(ns.label or runs[0]["model"], runs)], ns.plot)
        print(f"plot: {ns.plot}")
    return 0 if all(run["completed"] for run in runs) else 1


def _add_plot_parser(kinds) -> None:
    pl = kinds.add_parser(
        "plot",
        help="draw saved bench serve results side by side (one file per engine)",
        description="Each FILE is a `bench serve --output-json` file (one run, or several "
        "concurrency levels); each becomes one engine's lines.",
    )
    pl.add_argument("files", nargs="+", metavar="FILE")
    pl.add_argument("--labels", nargs="+", default=None, help="one per file (default: names)")
    pl.add_argument("--out", required=True, metavar="PNG")
    pl.add_argument("--title", default="tokenbus bench serve")
    pl.set_defaults(func=_plot)


def _plot(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenbus.bench.plot import Series, plot_serve

    labels = ns.labels or [Path(f).stem for f in ns.files]
    if len(labels) != len(ns.files):
        raise ValueError(f"labels: {len(labels)} given for {len(ns.files)} files")
    series = []
    for label, path in zip(labels, ns.files):
        with open(path) as f:
            data = json.load(f)
        series.append(Series(label, data["runs"] if "runs" in data else [data]))
    plot_serve(series, ns.out, ns.title)
    print(f"plot: {ns.out}")
    return 0


def _record_serve(ns: argparse.Namespace, summary: dict) -> None:
    from tokenbus.bench import record

    # --record only: the peer scripts run this client per server and record the whole run
    directory = ns.record
    if directory:
        rows, units = record.serve_summary_rows(summary)
        command = record.this_command(interpreter=False)
        entry = record.make_record("serve_client", command, rows, units=units)
        record.write_record(directory, entry | {"variant": summary["model"]})


def _serve_requests(ns: argparse.Namespace, serve):
    from tokenbus.bench.datasets import random_workload

    if ns.dataset_path:
        return serve.requests_from_jsonl(ns.dataset_path, ns.num_prompts, ns.output_len[1])
    workload = random_workload(
        ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), ns.dataset_seed, ns.vocab_size
    )
    tokenizer = None
    if ns.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer)
    return serve.requests_from_workload(workload, tokenizer)
