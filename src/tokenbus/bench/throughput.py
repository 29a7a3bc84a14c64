"""Offline throughput: tokenbus vs HF transformers static batches, same workload (L6)."""

from __future__ import annotations

import gc
import time

import torch

from tokenbus.api.llm import LLM
from tokenbus.bench.datasets import BenchRequest
from tokenbus.bench.report import BenchResult
from tokenbus.engine_args import EngineArgs
from tokenbus.sampling_params import SamplingParams


def run_tokenbus_throughput(
    args: EngineArgs, workload: list[BenchRequest], name: str = "tokenbus"
) -> BenchResult:
    llm = LLM.from_engine_args(args)
    warmup = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": workload[0].prompt_token_ids[:32]}], warmup, use_tqdm=False)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in workload
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_output == sum(r.output_len for r in workload), (
        "ignore_eos run produced short outputs"
    )
    totals = llm.engine.stats_totals
    result = BenchResult(
        name,
        len(workload),
        elapsed,
        sum(len(r.prompt_token_ids) for r in workload),
        num_output,
        extra={"preemptions": totals["num_preemptions"]},
    )
    llm.shutdown()
    del llm
    gc.collect()
    return result


def run_hf_throughput(
    args: EngineArgs, workload: list[BenchRequest], batch_size: int
) -> BenchResult:
    """HF `generate` on static batches (left-padded), greedy, EOS ignored, same weights and
    dtype."""
    from tokenbus.bench.hf_peer import load_hf_model

    model = load_hf_model(args.model, args.dtype)
    pad_id = 0
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        input_ids, attention_mask = _left_pad([r.prompt_token_ids for r in batch], pad_id)
        max_new = max(r.output_len for r in batch)  # a static batch runs to its longest output
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=pad_id,
            )
    elapsed = time.perf_counter() - start
    return BenchResult(
        f"hf-transformers (bs={batch_size})",
        len(workload),
        elapsed,
        sum(len(r.prompt_token_ids) for r in workload),
        sum(r.output_len for r in workload),
    )


def _left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        mask[row, width - len(seq) :] = 1
    return ids, mask
