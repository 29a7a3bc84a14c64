"""Structured output overhead: a batch of constrained requests vs the same batch unconstrained
(L6)."""

from __future__ import annotations

import gc
import time

from tokenbus.api.llm import LLM
from tokenbus.bench.report import BenchResult
from tokenbus.engine_args import EngineArgs
from tokenbus.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}


def run_structured_bench(args: EngineArgs, num_prompts: int, max_tokens: int) -> list[BenchResult]:
    llm = LLM.from_engine_args(args)
    compile_times = _compile_times(llm)
    prompts = [
        llm.engine.input_processor.render_chat(
            [
                {
                    "role": "user",
                    "content": f"Describe person number {i} as JSON with name, age, hobbies, city.",
                }
            ]
        )[1]
        for i in range(num_prompts)
    ]
    # Constrained first; then the same prompts unconstrained with each request's max_tokens set
    # to its constrained length (EOS ignored): the same batch shape step by step, so the time
    # difference is the grammar's cost.
    constrained = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        )
        for i in range(num_prompts)
    ]
    # Warm-up: the engine builds its grammar backend (tokenizer info) at the first constrained
    # request; that one-off start-up cost is not per-request overhead.
    llm.generate(
        [{"prompt_token_ids": prompts[0]}], constrained[0].clone(max_tokens=4), use_tqdm=False
    )
    json_result, lengths = _timed(llm, prompts, constrained, "json schema")
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    free_result, _ = _timed(llm, prompts, free, "unconstrained")
    results = [free_result, json_result]
    results[1].extra.update(compile_times)
    llm.shutdown()
    del llm
    gc.collect()
    return results


def _compile_times(llm: LLM) -> dict[str, float]:
    validator = llm.engine.input_processor.structured_validator
    spec = StructuredOutputsParams(json=SCHEMA)
    validator.validate(StructuredOutputsParams(json_object=True))  # build the tokenizer info first
    start = time.perf_counter()
    validator.validate(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    validator.validate(spec)
    cached = time.perf_counter() - start
    return {"compile_cold_ms": cold * 1e3, "compile_cached_ms": cached * 1e3}


def _timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], name: str):
    llm.reset_prefix_cache()  # neither run may reuse the other's prompt KV
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return BenchResult(
        name, len(prompts), elapsed, sum(len(p) for p in prompts), sum(lengths)
    ), lengths
