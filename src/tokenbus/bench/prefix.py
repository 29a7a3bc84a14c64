"""Shared-prefix workload: the same long system prompt, distinct questions; caching on vs off
(L6)."""

from __future__ import annotations

import dataclasses
import gc
import time

from tokenbus.api.llm import LLM
from tokenbus.bench.datasets import shared_prefix_workload
from tokenbus.bench.report import BenchResult
from tokenbus.engine_args import EngineArgs
from tokenbus.loader import load_arch, resolve_model
from tokenbus.sampling_params import SamplingParams


def run_prefix_bench(
    args: EngineArgs,
    num_prompts: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchResult]:
    vocab_size = load_arch(resolve_model(args.model)).vocab_size
    workload = shared_prefix_workload(
        num_prompts, prefix_len, question_len, output_len, seed, vocab_size
    )
    results = []
    for caching in (True, False):
        run_args = dataclasses.replace(args, enable_prefix_caching=caching)
        results.append(_run(run_args, workload, f"prefix caching {'on' if caching else 'off'}"))
    return results


def _run(args: EngineArgs, workload, name: str) -> BenchResult:
    llm = LLM.from_engine_args(args)
    # Warm up on unrelated tokens so the timed run starts with an empty prefix cache.
    llm.generate(
        [{"prompt_token_ids": [1000 + i for i in range(20)]}],
        SamplingParams(max_tokens=2, temperature=0.0),
        use_tqdm=False,
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = SamplingParams(max_tokens=workload[0].output_len, ignore_eos=True, temperature=0.0)
    start_totals = dict(llm.engine.stats_totals)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    totals = {k: v - start_totals[k] for k, v in llm.engine.stats_totals.items()}
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    queries = totals["prefix_cache_queries"]
    extra = {
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "prefix_cache_hit_rate": totals["prefix_cache_hits"] / queries if queries else 0.0,
    }
    result = BenchResult(
        name,
        len(workload),
        elapsed,
        sum(len(r.prompt_token_ids) for r in workload),
        sum(len(o.outputs[0].token_ids) for o in outputs),
        extra,
    )
    llm.shutdown()
    del llm
    gc.collect()
    return result
