"""Speculative decoding on vs off, same run, same model (default: SmolLM2-135M-Instruct).

    python benchmarks/spec_decode.py                                   # n-gram, k=4
    python benchmarks/spec_decode.py \
        --spec '{"method": "draft_model", "draft_layers": 20, "num_speculative_tokens": 3}'

Three workloads, greedy (outputs are identical on and off, so both produce the same tokens):
  copy     single requests that repeat or lightly edit text (and code) given in the prompt
  chat     single requests with ordinary questions
  batch    concurrency 16: copy and chat prompts together, max_num_seqs=16
Single-request figures run each prompt alone, alternating which engine goes first, so that
drift in machine load hits both engines alike. Reports output tokens/s, the speed-up, and the
acceptance figures of the spec engine (drafted, accepted, rate per position, mean accepted length).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenbus import LLM, SamplingParams
from tokenbus.bench.record import make_record, record_dir, this_command, write_record
from tokenbus.bench.report import machine_description
from tokenbus.core.sched.spec_metrics import SpecDecodeMetrics

SOLAR = (
    "Solar panels convert sunlight into electricity using photovoltaic cells. When light hits a "
    "cell, it knocks electrons loose from their atoms, and the flow of those electrons is an "
    "electric current. Most home systems connect to the grid, so extra power can be sold back "
    "during the day and bought again at night. Panels last about twenty-five years and need "
    "little care beyond the occasional cleaning."
)
BREAD = (
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and "
    "seven grams of dried yeast. Add three hundred and fifty millilitres of warm water and knead "
    "the dough for ten minutes until it is smooth and elastic. Leave it to rise in a warm place "
    "for an hour, shape it into a loaf, let it rise again, and bake it at two hundred and twenty "
    "degrees for thirty minutes."
)
TYPOS = (
    SOLAR.replace("electricity", "electrisity")
    .replace("electrons", "electorns")
    .replace("little", "litle")
)
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "print(add(2, 3), mul(4, 5))\n"
)
# SmolLM2-135M copies and lightly edits prose faithfully; it tends to rewrite code instead.
COPY_QUESTIONS = [
    f"Copy this text word for word:\n\n{SOLAR}\n\n{BREAD}",
    f"Fix the spelling mistakes in this text and write the corrected text:\n\n{TYPOS}",
    f"Rewrite this text, replacing 'Solar panels' with 'PV modules':\n\n{SOLAR}",
    f"Repeat this recipe exactly:\n\n{BREAD}",
    f"Copy this code exactly:\n\n```python\n{CODE}```",
]
CHAT_QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain in a few sentences how a CPU works.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
]


def chat_prompts(llm: LLM, questions: list[str]) -> list[list[int]]:
    render = llm.engine.input_processor.render_chat
    return [render([{"role": "user", "content": q}])[1] for q in questions]


def timed_generate(
    llm: LLM, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def run_single(engines: dict[str, LLM], prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt alone on each engine, alternating the order; tokens/s over all prompts."""
    elapsed = {name: 0.0 for name in engines}
    num_tokens = {name: 0 for name in engines}
    names = list(engines)
    with engines["spec"].engine.measure_spec_decode() as metrics:
        for i, prompt in enumerate(prompts):
            outputs = {}
            for name in names if i % 2 == 0 else names[::-1]:
                seconds, (tokens,) = timed_generate(engines[name], [prompt], max_tokens)
                elapsed[name] += seconds
                num_tokens[name] += len(tokens)
                outputs[name] = tokens
            if outputs["spec"] != outputs["plain"]:
                print(f"  warning: prompt {i}: greedy outputs differ")
    return _summary(elapsed, num_tokens, metrics)


def run_batch(engines: dict[str, LLM], prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once on each engine in turn; acceptance figures from the spec engine's run."""
    elapsed, outputs = {}, {}
    elapsed["plain"], outputs["plain"] = timed_generate(engines["plain"], prompts, max_tokens)
    with engines["spec"].engine.measure_spec_decode() as metrics:
        elapsed["spec"], outputs["spec"] = timed_generate(engines["spec"], prompts, max_tokens)
    num_tokens = {name: sum(len(t) for t in tokens) for name, tokens in outputs.items()}
    return _summary(elapsed, num_tokens, metrics)


def _summary(elapsed: dict, num_tokens: dict, metrics: SpecDecodeMetrics) -> dict:
    speed = {name: num_tokens[name] / elapsed[name] for name in elapsed}
    return {
        "output_tokens": num_tokens,
        "elapsed_s": {k: round(v, 2) for k, v in elapsed.items()},
        "output_tokens_per_s": {k: round(v, 2) for k, v in speed.items()},
        "speedup": round(speed["spec"] / speed["plain"], 3),
        "spec": metrics.to_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    parser.add_argument(
        "--spec",
        default='{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--workloads", default="copy,chat,batch")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 is steadier on a loaded machine",
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--record", default=None, metavar="DIR", help="write a run record under DIR/spec_decode/"
    )
    ns = parser.parse_args()

    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    # In-process engines: both share this process's thread setting, and no IPC per step.
    common = dict(
        max_model_len=2048,
        kv_cache_memory="768MiB",
        seed=0,
        max_num_seqs=ns.concurrency,
        multiprocess=False,
    )
    engines = {
        "plain": LLM(ns.model, **common),
        "spec": LLM(ns.model, speculative_config=ns.spec, **common),
    }
    copy = chat_prompts(engines["plain"], COPY_QUESTIONS)
    chat = chat_prompts(engines["plain"], CHAT_QUESTIONS)
    for llm in engines.values():  # warm-up: first-call allocations and kernel selection
        timed_generate(llm, [chat[0]], 8)
    results = {
        "spec_config": json.loads(ns.spec),
        "max_tokens": ns.max_tokens,
        "machine": machine_description(),
    }
    workloads = ns.workloads.split(",")
    if "copy" in workloads:
        results["copy_single"] = run_single(engines, copy, ns.max_tokens)
        _print("copy, single request", results["copy_single"])
    if "chat" in workloads:
        results["chat_single"] = run_single(engines, chat, ns.max_tokens)
        _print("chat, single request", results["chat_single"])
    if "batch" in workloads:
        mixed = [(copy + chat)[i % (len(copy) + len(chat))] for i in range(ns.batch_prompts)]
        results["batch"] = run_batch(engines, mixed, ns.max_tokens)
        _print(f"batch of {ns.batch_prompts}, concurrency {ns.concurrency}", results["batch"])
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=2)
    if record_dir(ns.record):
        write_record(record_dir(ns.record), spec_record(ns, results))
    for llm in engines.values():
        llm.shutdown()


def spec_record(ns: argparse.Namespace, results: dict) -> dict:
    """The workloads' rates and acceptance as a run record, plain and speculative side by side."""
    labels = {
        "copy_single": "copy-heavy, 1 request",
        "chat_single": "chat, 1 request",
        "batch": f"{ns.batch_prompts} prompts, concurrency {ns.concurrency}",
    }
    rows = {}
    for key, label in labels.items():
        if key in results:
            speed, spec = results[key]["output_tokens_per_s"], results[key]["spec"]
            rows[label] = {
                "plain": round(speed["plain"], 1),
                "speculative": round(speed["spec"], 1),
                "speed-up": round(results[key]["speedup"], 2),
                "acceptance": round(spec["acceptance_rate"], 2),
            }
    config = json.loads(ns.spec)
    tokens = config.get("num_speculative_tokens")
    if "draft_layers" in config:
        variant = f"first {config['draft_layers']} layers as draft, {tokens} tokens"
    else:
        variant = f"{config.get('method', 'ngram').replace('ngram', 'n-gram')}, {tokens} tokens"
    units = {"plain": "tok/s", "speculative": "tok/s", "speed-up": "×"}
    peers = ["the same engine without speculation"]
    return make_record(
        "spec_decode", this_command(), rows, units=units, peers=peers, variant=variant
    )


def _print(title: str, result: dict) -> None:
    speed, spec = result["output_tokens_per_s"], result["spec"]
    print(
        f"{title}: plain {speed['plain']:.1f} tok/s, spec {speed['spec']:.1f} tok/s "
        f"({result['speedup']:.2f}x); acceptance {spec['acceptance_rate']:.2f}, "
        f"mean accepted length {spec['mean_acceptance_length']:.2f}, "
        f"per position {spec['acceptance_rate_per_pos']}, drafts {spec['num_drafts']}"
    )


if __name__ == "__main__":
    main()
