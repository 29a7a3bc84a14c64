"""Eager vs captured decode steps in one run: CUDA graphs on CUDA; on CPU the default step (each
decoder layer in one C call, model/native/decode_layer.c). "eager" is --enforce-eager: every
layer op by op.

1. Step latency: `batch` decode requests of `--context` cached tokens (random K/V, shuffled
   blocks) through the worker's own path (prepare_batch -> forward -> compute_logits of the
   sampled rows), the modes interleaved round by round (a shared machine drifts; ratios of the
   same run hold), median and min of each.
2. Single-request decode: tokens/s of one greedy request (--gen-tokens tokens) through LLM
   (scheduler, sampler and all, the EngineCore in this process): --enforce-eager, the default
   (on CPU: C layers) and --cudagraph-capture-sizes 1.
3. Start-up: LLM construction time in fresh processes on an empty cache dir (cold), then
   again on the same dir (warm), for the same modes.

    python benchmarks/captured_decode.py [--quantization auto|none] [--batches 1 8 16 64]
        [--device cpu|cuda] [--threads 2] [--rounds 20] [--skip-e2e] [--skip-startup]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from tokenbus.bench.record import make_record, record_dir, this_command, write_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(args):
    from tokenbus.engine.setup import resolve_dtype, resolve_quantization
    from tokenbus.engine_args import EngineArgs
    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.utils import cdiv
    from tokenbus.worker.input_batch import InputBuffers
    from tokenbus.worker.kv_cache import allocate_kv_caches
    from tokenbus.worker.model_builder import load_model

    device = torch.device(args.device)
    src = resolve_model(args.model)
    arch = load_arch(src)
    dtype = getattr(torch, resolve_dtype(args.dtype, args.device))
    quantization = resolve_quantization(args.quantization, src, args.device)
    model = load_model(src, arch, dtype, device, "auto", quantization=quantization)
    eager_model = load_model(
        src, arch, dtype, device, "auto", quantization=quantization, enforce_eager=True
    )
    max_batch = max(args.batches)
    config = EngineArgs(
        model=args.model,
        max_num_seqs=max_batch,
        max_model_len=args.max_model_len,
        cudagraph_capture_sizes=sorted(set(args.batches)),
    ).to_config(args.max_model_len)
    bs = config.cache.block_size
    num_blocks = max_batch * cdiv(args.context + 1, bs) + 2
    kv = allocate_kv_caches(arch, num_blocks, bs, dtype, device)
    g = torch.Generator().manual_seed(0)
    for cache in kv:
        cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    buffers = InputBuffers(
        config.scheduler.max_num_batched_tokens, max_batch, cdiv(args.max_model_len, bs) + 1, device
    )
    return model, eager_model, arch, config, kv, buffers


def make_requests(
    batch: int, context: int, block_size: int, num_blocks: int, vocab: int, seed: int
):
    from tokenbus.sampling_params import SamplingParams
    from tokenbus.worker.input_batch import ScheduledRequest
    from tokenbus.worker.request_state import CachedRequestState

    g = torch.Generator().manual_seed(seed)
    per_req = -(-(context + 1) // block_size)
    perm = (
        (torch.randperm(num_blocks - 1, generator=g)[: batch * per_req] + 1)
        .view(batch, per_req)
        .tolist()
    )
    requests = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context + 1,), generator=g).tolist()
        state = CachedRequestState(
            f"r{i}", prompt, [], SamplingParams(max_tokens=1), perm[i], context
        )
        requests.append(ScheduledRequest(state, 1, []))
    return requests


def plain_step(model, requests, buffers, block_size: int, kv):
    """One uncaptured step of `requests` through `model`: the worker's path, logits of the
    sampled rows (what "eager" and the C layers run)."""
    from tokenbus.worker.input_batch import prepare_batch

    def step():
        batch = prepare_batch(requests, buffers, block_size, kv)
        batch.ctx.attn_metadata = model.attention_backend.build_metadata(batch.ctx)
        return model.compute_logits(model(batch.input_ids, batch.ctx)[batch.logits_indices])

    return step


def step_latency(args) -> list[dict]:
    from tokenbus.worker.captured_step import CapturedSteps
    from tokenbus.worker.input_batch import prepare_batch

    model, eager_model, arch, config, kv, buffers = build(args)
    bs = config.cache.block_size
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:  # CPUs capture nothing (worker/captured_step.py): eager against the C layers
        from tokenbus.worker.cuda_graphs import CudaGraphRunner

        runner = CudaGraphRunner(model, torch.device("cuda"))
        steps = CapturedSteps(
            model, runner, config.compilation.cudagraph_capture_sizes, buffers, bs, kv
        )
        with torch.inference_mode():
            start = time.perf_counter()
            steps.capture_all()
            sync()
            capture_s = time.perf_counter() - start
        print(f"captured sizes {list(steps.dispatcher.sizes)} in {capture_s:.1f} s", flush=True)
    results = []
    for batch_size in args.batches:
        requests = make_requests(
            batch_size, args.context, bs, kv[0].shape[1], arch.vocab_size, batch_size
        )

        def captured():
            batch = prepare_batch(requests, buffers, bs, kv, steps.shape(requests))
            return model.compute_logits(steps.run(batch)[: batch.num_tokens][batch.logits_indices])

        modes = {"eager": plain_step(eager_model, requests, buffers, bs, kv)}
        if cuda:
            modes["captured"] = captured
        else:
            modes["c_layers"] = plain_step(model, requests, buffers, bs, kv)
        times = {name: [] for name in modes}
        with torch.inference_mode():
            reference = modes["eager"]()
            diff = {name: (reference - fn()).abs().max().item() for name, fn in modes.items()}
            for _ in range(3):
                for fn in modes.values():
                    fn()
            sync()
            for _ in range(args.rounds):
                for name, fn in modes.items():
                    start = time.perf_counter()
                    fn()
                    sync()
                    times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        low = {k: min(v) * 1e3 for k, v in times.items()}
        row = dict(
            batch=batch_size,
            **{f"{k}_ms": v for k, v in med.items()},
            **{f"{k}_min_ms": v for k, v in low.items()},
            max_abs_logit_diff=diff,
        )
        print(
            f"batch {batch_size:3d}: "
            + "  ".join(
                f"{name} {med[name]:7.2f} ms (min {low[name]:.2f}"
                + ("" if name == "eager" else f", x{med['eager'] / med[name]:.2f}")
                + ")"
                for name in modes
            )
            + f"  max |dlogit| vs eager {max(diff.values()):.1e}",
            flush=True,
        )
        results.append(row)
    return results


E2E = """
import json, sys, time
import torch
from tokenbus import LLM, SamplingParams
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
llm = LLM(args["model"], multiprocess=False, enable_prefix_caching=False,
          max_model_len=args["max_model_len"], max_num_seqs=args["max_num_seqs"],
          quantization=args["quantization"], device=args["device"],
          num_threads=args.get("threads"), **args["mode"])
start_s = time.perf_counter() - t0
out = {"start_s": start_s}
if args["gen_tokens"]:
    params = SamplingParams(temperature=0.0, max_tokens=args["gen_tokens"],
                            min_tokens=args["gen_tokens"], ignore_eos=True)
    request = [{"prompt_token_ids": [1234, 567, 89]}]
    llm.generate(request, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(args["repeats"]):
        t = time.perf_counter()
        llm.generate(request, params, use_tqdm=False)
        best = max(best, args["gen_tokens"] / (time.perf_counter() - t))
    out["tok_s"] = best
print("RESULT", json.dumps(out))
llm.shutdown()
"""


def run_llm(args, mode: dict, cache: str, gen_tokens: int) -> dict:
    env = dict(os.environ, TOKENBUS_CACHE_DIR=cache, PYTHONPATH=os.path.join(ROOT, "src"))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    spec = dict(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches),
        quantization=args.quantization,
        device=args.device,
        threads=args.threads,
        mode=mode,
        gen_tokens=gen_tokens,
        repeats=args.repeats,
    )
    done = subprocess.run(
        [sys.executable, "-c", E2E, json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--record", default=None, metavar="DIR", help="write a run record under DIR/decode_layers/"
    )
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    from tokenbus.utils.cpu import CpuFeatures

    print(
        f"torch {torch.__version__}, {args.device}, CPU: {CpuFeatures.detect().describe()}, "
        f"quantization {args.quantization}, {args.threads} threads",
        flush=True,
    )
    report: dict = {"device": args.device, "quantization": args.quantization}
    if not args.skip_latency:
        report["latency"] = step_latency(args)
    eager, default, captured = dict(enforce_eager=True), {}, dict(cudagraph_capture_sizes=[1])
    modes = {"eager": eager, "default": default}
    if args.device == "cuda":  # on CPU the default is the C layers and nothing is captured
        modes["captured"] = captured
    with tempfile.TemporaryDirectory() as cache:
        if not args.skip_e2e:
            rates = {
                name: run_llm(args, mode, cache, args.gen_tokens)["tok_s"]
                for name, mode in modes.items()
            }
            report["single_request_tok_s"] = rates
            print(
                "single request: "
                + ", ".join(
                    f"{name} {rate:.1f} tok/s (x{rate / rates['eager']:.2f})"
                    for name, rate in rates.items()
                ),
                flush=True,
            )
    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as cache:
            run_llm(args, eager, cache, 0)  # the native kernels built: not what is measured here
            start = {name: run_llm(args, mode, cache, 0)["start_s"] for name, mode in modes.items()}
        report["startup_s"] = start
        print(
            "start-up: "
            + ", ".join(
                f"{name} {t:.1f} s (+{t - start['eager']:.1f})" for name, t in start.items()
            ),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if record_dir(args.record):
        write_record(record_dir(args.record), decode_record(args, report))


def decode_record(args, report: dict) -> dict:
    """Step latencies (median), the single-request rate and start-up as a run record: one
    column per mode, and each fast mode's speed-up over eager."""
    names = {
        "c_layers": "C layers (default)",
        "default": "C layers (default)" if args.device == "cpu" else "default",
        "captured": "CUDA graphs",
    }
    rows: dict[str, dict] = {}
    units = {}

    def add(label: str, unit: str, values: dict[str, float], faster_is_smaller: bool) -> None:
        cells = {names.get(k, k): round(v, 2) for k, v in values.items()}
        for k, v in values.items():
            if k != "eager" and unit != "s":
                ratio = values["eager"] / v if faster_is_smaller else v / values["eager"]
                cells[f"{names.get(k, k)} / eager"] = round(ratio, 2)
        rows[label], units[label] = cells, unit

    for row in report.get("latency", []):
        modes = {
            k[: -len("_ms")]: v for k, v in row.items() if k.endswith("_ms") and "_min" not in k
        }
        add(f"batch {row['batch']} step", "ms", modes, True)
    if "single_request_tok_s" in report:
        label = f"1 request, {args.gen_tokens} greedy tokens"
        add(label, "tok/s", report["single_request_tok_s"], False)
    if "startup_s" in report:
        add("start-up (LLM construction)", "s", report["startup_s"], True)
    units |= {c: "×" for cells in rows.values() for c in cells if c.endswith("/ eager")}
    variant = "" if args.device == "cpu" else args.device
    peers = ["--enforce-eager, interleaved in the same process"]
    return make_record(
        "decode_layers", this_command(), rows, units=units, peers=peers, variant=variant
    )


if __name__ == "__main__":
    main()
