"""KV memory and c16 decode throughput at 8k context with quantized K/V (--kv-cache-dtype).

    .venv/bin/python benchmarks/kv_cache_dtype.py --record benchmarks/results
    .venv/bin/python benchmarks/kv_cache_dtype.py --dtypes float16,q8_0 --rounds 3

On the packaged SmolLM2-135M Q4_1 GGUF as the engine runs it on CPU (GGUF blocks kept, fp32
activations, the native attention kernel, each decoder layer in C), per K/V dtype:
  pool   an engine built with --kv-cache-memory (default 2 GiB, the CPU default): the tokens its
         KV blocks hold (the blocks' real bytes), and how many requests of 8,192 tokens
         (SmolLM2's longest) fit at once
  agreement  the same engine's greedy answers to 8 chat questions (--answer-tokens each, EOS
         ignored): how many equal the first dtype's, and the mean and 95th percentile of
         |logprob difference| per token over the first dtype's answers, read back as prompt
         logprobs (the same text under both: no drift after a first different token);
         --reference-dtypes (default float32) get this row alone, for scale
  c16    decode steps of --concurrency requests with --context tokens each already in the
         cache (the same random K/V for every dtype, rounded into it; every request its own
         blocks, shuffled), 16 tokens a step: the model's forward and logits, the median of
         --rounds rounds that take the dtypes in turn so that machine drift hits all alike.
         Prefilling 16 x 8k tokens would take ~10 minutes a dtype on two cores; a decode step
         reads the cache the same way whoever wrote it. On a busy machine, --threads 1
         --cpu-time times the step in CPU seconds of one thread, which other work does not
         stretch the way it stretches two threads that wait for each other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenbus import LLM, SamplingParams
from tokenbus.bench.record import make_record, record_dir, this_command, write_record
from tokenbus.model import ForwardContext, kv_quant
from tokenbus.utils import parse_size

MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Explain photosynthesis briefly.",
    "How do I sort a list in Python?",
    "Why is the sky blue?",
    "Tell me a short joke.",
]


def engine_figures(ns: argparse.Namespace, kv_cache_dtype: str, texts: list[list[int]] | None):
    """An engine's pool (tokens its blocks hold; block 0 is null), its greedy answers to
    QUESTIONS, and the logprob of every token of `texts` (default: the prompts with their answers)
    read back as prompt logprobs. Returns (pool tokens, answers, texts, logprobs per text)."""
    llm = LLM(
        None,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=ns.kv_cache_memory,
        max_model_len=MAX_MODEL_LEN,
        multiprocess=False,
        seed=0,
    )
    try:
        tokens = (llm.engine.client.engine_core.num_kv_blocks - 1) * BLOCK_SIZE
        render = llm.engine.input_processor.render_chat
        prompts = [render([{"role": "user", "content": q}])[1] for q in QUESTIONS]
        n = ns.answer_tokens
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        texts = texts or [p + a for p, a in zip(prompts, answers)]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": t} for t in texts], params, use_tqdm=False)
        read = [
            [entry[text[i]].logprob for i, entry in enumerate(o.prompt_logprobs) if i >= len(p)]
            for o, text, p in zip(outputs, texts, prompts)
        ]
        return tokens, answers, texts, read
    finally:
        llm.shutdown()


def pools_and_agreement(ns: argparse.Namespace) -> tuple[dict[str, int], dict[str, dict]]:
    first = ns.dtypes[0]
    tokens, answers, texts, read = engine_figures(ns, first, None)
    pools, agreement = {first: tokens}, {}
    for name in ns.dtypes[1:] + ns.reference_dtypes:
        pools[name], ours, _, ours_read = engine_figures(ns, name, texts)
        diffs = sorted(abs(a - b) for x, y in zip(ours_read, read) for a, b in zip(x, y))
        agreement[name] = {
            "identical": sum(a == b for a, b in zip(ours, answers)),
            "mean": statistics.mean(diffs),
            "p95": diffs[int(0.95 * len(diffs))],
        }
        print(
            f"{name}: {agreement[name]['identical']} of {len(QUESTIONS)} answers as {first}'s; "
            f"|logprob difference| mean {agreement[name]['mean']:.4f}, "
            f"p95 {agreement[name]['p95']:.4f}",
            flush=True,
        )
    for name, count in pools.items():
        print(f"{name}: pool {count} tokens ({count // MAX_MODEL_LEN} x {MAX_MODEL_LEN})")
    return pools, agreement


def load_engine_model():
    """The model as the engine loads it on CPU by default."""
    from tokenbus.engine.setup import resolve_quantization
    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.worker.model_builder import load_model

    src = resolve_model(None)
    arch = load_arch(src)
    quantization = resolve_quantization("auto", src, "cpu")
    return load_model(src, arch, torch.float32, "cpu", quantization=quantization), arch


def random_pools(arch, dtypes: list[str], num_blocks: int) -> dict[str, list[torch.Tensor]]:
    """Per dtype, one cache per layer holding the same random K/V (|x| up to ~8)."""
    from tokenbus.worker.kv_cache import allocate_kv_caches

    g = torch.Generator().manual_seed(0)
    pools = {
        name: allocate_kv_caches(
            arch, num_blocks, BLOCK_SIZE, kv_quant.kv_storage_dtype(name), torch.device("cpu")
        )
        for name in dtypes
    }
    shape = (2, num_blocks, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    for layer in range(arch.num_hidden_layers):
        values = torch.randn(shape, generator=g) * 2
        for caches in pools.values():
            caches[layer].view(torch.uint8).copy_(
                kv_quant.quantize(values, caches[layer].dtype).view(torch.uint8)
            )
    return pools


def decode_context(model, kv_caches, batch: int, context: int, tables: torch.Tensor):
    """`batch` decode requests at position `context` over their blocks (`tables`)."""
    slots = tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
    seq = [context + 1] * batch
    ctx = ForwardContext(
        positions=torch.full((batch,), context),
        slot_mapping=slots,
        kv_caches=kv_caches,
        block_size=BLOCK_SIZE,
        query_start_loc=list(range(batch + 1)),
        seq_lens=seq,
        seq_lens_t=torch.tensor(seq),
        block_tables=tables,
        num_decodes=batch,
    )
    ctx.attn_metadata = model.attention_backend.build_metadata(ctx)
    return ctx


def decode_rates(ns: argparse.Namespace) -> dict[str, dict]:
    """Median decode step per dtype; tokens per second of the batch."""
    model, arch = load_engine_model()
    blocks_per_req = (ns.context + BLOCK_SIZE) // BLOCK_SIZE
    num_blocks = ns.concurrency * blocks_per_req + 1
    pools = random_pools(arch, ns.dtypes, num_blocks)
    g = torch.Generator().manual_seed(1)
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1).view(ns.concurrency, -1)
    ids = torch.randint(0, arch.vocab_size, (ns.concurrency,), generator=g)
    contexts = {
        name: decode_context(model, caches, ns.concurrency, ns.context, tables)
        for name, caches in pools.items()
    }
    steps = {name: [] for name in ns.dtypes}
    clock = time.process_time if ns.cpu_time else time.perf_counter
    with torch.inference_mode():
        for round_ in range(ns.rounds + 1):  # round 0 warms up
            for name, ctx in contexts.items():
                start = clock()
                model.compute_logits(model(ids, ctx))
                if round_:
                    steps[name].append(clock() - start)
    results = {}
    for name in ns.dtypes:
        step = statistics.median(steps[name])
        results[name] = {"step_ms": step * 1e3, "tok_s": ns.concurrency / step}
        print(
            f"{name}: c{ns.concurrency} decode step at {ns.context} tokens {step * 1e3:.1f} ms "
            f"(min {min(steps[name]) * 1e3:.1f}), {ns.concurrency / step:.1f} tok/s",
            flush=True,
        )
    return results


def kv_bytes_per_token(kv_cache_dtype: str) -> int:
    """K and V of one token over every layer, in the pool's real bytes."""
    from tokenbus.config import kv_row_bytes
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(None))
    row = kv_row_bytes(kv_cache_dtype, arch.head_dim)
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * row


def kv_record(
    ns: argparse.Namespace, pools: dict[str, int], rates: dict[str, dict], agreement: dict
) -> dict:
    first = ns.dtypes[0]
    c = f"c{ns.concurrency}"
    rows = {}
    for name in ns.dtypes + ns.reference_dtypes:
        rows[name] = {
            "KV bytes/token": kv_bytes_per_token(name),
            "pool tokens": pools[name],
            "8k requests in pool": pools[name] // MAX_MODEL_LEN,
            f"tokens / {first}": round(pools[name] / pools[first], 2),
        }
        if name in rates:
            rows[name] |= {
                f"{c} decode": round(rates[name]["tok_s"], 1),
                f"{c} / {first}": round(rates[name]["tok_s"] / rates[first]["tok_s"], 2),
            }
        if name in agreement:
            same = agreement[name]
            rows[name] |= {
                f"answers as {first}'s": f"{same['identical']} of {len(QUESTIONS)}",
                "mean abs Δ logprob": round(same["mean"], 3),
                "p95 abs Δ logprob": round(same["p95"], 3),
            }
    units = {f"{c} decode": "tok/s", f"tokens / {first}": "×", f"{c} / {first}": "×"}
    timing = "CPU time" if ns.cpu_time else "wall time"
    variant = (
        f"{ns.kv_cache_memory / 2**30:g} GiB pool; {c} at {ns.context} tokens, "
        f"{torch.get_num_threads()} thread(s), {timing}; load {ns.load_before:.1f}"
    )
    peers = [f"--kv-cache-dtype {first}"]
    return make_record(
        "kv_cache_dtype", this_command(), rows, units=units, peers=peers, variant=variant
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dtypes",
        default="float16,fp8_e4m3,fp8_e5m2,q8_0",
        help="--kv-cache-dtype values, comma-separated; the first is the baseline",
    )
    parser.add_argument(
        "--reference-dtypes",
        default="float32",
        help="dtypes measured for pool and agreement only (no decode pool), comma-separated",
    )
    parser.add_argument("--kv-cache-memory", type=parse_size, default="2GiB")
    parser.add_argument("--context", type=int, default=8000, help="cached tokens per request")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for the decode part"
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time decode steps in process CPU seconds"
    )
    parser.add_argument(
        "--record", default=None, metavar="DIR", help="write a run record under DIR/kv_cache_dtype/"
    )
    ns = parser.parse_args()
    ns.dtypes = ns.dtypes.split(",")
    ns.reference_dtypes = [name for name in ns.reference_dtypes.split(",") if name]
    if ns.context >= MAX_MODEL_LEN:
        parser.error(f"--context must be below {MAX_MODEL_LEN}")
    ns.load_before = os.getloadavg()[0]  # two cores: other work skews the decode figures
    pools, agreement = pools_and_agreement(ns)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rates = decode_rates(ns)
    if record_dir(ns.record):
        write_record(record_dir(ns.record), kv_record(ns, pools, rates, agreement))


if __name__ == "__main__":
    main()
