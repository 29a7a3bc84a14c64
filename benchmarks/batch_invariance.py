"""--batch-invariant: what it fixes and what it costs, both measured in one run on one machine.

Invariance: 32 prompts sharing a ~360-token prefix (tests/e2e/test_batch_invariant_smollm2.py's
workload), greedy, 16 tokens with their logprobs, in four settings: each prompt alone and the 32
among 16 other prompts, with prefix caching on (--max-num-batched-tokens 2048) and off (128: a
prompt in three chunks). Against the first setting (alone, caching on): how many of the 32
answers (token ids) and how many logprob sequences differ in any setting, and the largest
logprob difference among the answers that agree. Once with the switch off (the default), once on.

Cost: offline throughput with the switch off and on, the two engines built once each and run in
alternating rounds (the machine may be shared: the best round of each counts) on three short
workloads: prefill (4 prompts of 1024 tokens, one output token each), decode (16 prompts of 64
tokens, 64 output tokens each) and mixed (16 prompts of 20-600 tokens, 16-64 output tokens).

    .venv/bin/python benchmarks/batch_invariance.py [--rounds 8] [--record benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from tokenbus import LLM, SamplingParams  # noqa: E402 - after the path

WORDS = (
    "the engine cache block token prompt model batch step queue page memory request reply turn "
    "chat user system answer question data value table report month sales region team plan "
    "budget risk task review draft summary detail number list order price"
).split()
SETTINGS = (  # (name, prefix caching, token budget, alone)
    ("alone, caching on", True, 2048, True),
    ("among 16 others, caching on", True, 2048, False),
    ("alone, caching off, chunks of 128", False, 128, True),
    ("among 16 others, caching off, chunks of 128", False, 128, False),
)
MODES = {"default": False, "--batch-invariant": True}
ANSWERS = "shared-prefix prompts (of 32) whose answer changes"
LOGPROBS = "shared-prefix prompts (of 32) whose logprobs change"
LARGEST = "largest logprob change, same answer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--skip-invariance", action="store_true")
    parser.add_argument("--record", default=None, metavar="DIR")
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    if not args.skip_invariance:
        for mode, invariant in MODES.items():
            for label, value in invariance_counts(args.model, mode, invariant).items():
                rows.setdefault(label, {})[mode] = value
    rows.update(cost_rows(args.model, args.rounds))
    print(json.dumps(rows, indent=1))
    if args.record:
        write_record(args, rows)


def engine(model: str | None, invariant: bool, **kwargs) -> LLM:
    return LLM(
        model,
        seed=0,
        multiprocess=False,
        batch_invariant=invariant,
        kv_cache_memory="1GiB",
        max_model_len=2048,
        **kwargs,
    )


def shared_prefix_prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    report = " ".join(rng.choice(WORDS) for _ in range(330))
    prefix = tokenizer.encode(f"Read this report and answer.\n{report}\n", add_special_tokens=False)
    shared = [
        prefix
        + tokenizer.encode(
            f"Question {i}: what is item {rng.choice(WORDS)} number {7 * i}? Answer:",
            add_special_tokens=False,
        )
        for i in range(32)
    ]
    others = [
        tokenizer.encode(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200))),
            add_special_tokens=False,
        )
        for _ in range(16)
    ]
    return shared, others


def greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def invariance_counts(model: str | None, mode: str, invariant: bool) -> dict[str, float]:
    results = {}
    for name, caching, budget, alone in SETTINGS:
        llm = engine(model, invariant, enable_prefix_caching=caching, max_num_batched_tokens=budget)
        shared, others = shared_prefix_prompts(llm.get_tokenizer())
        if alone:
            results[name] = [greedy(llm, [p])[0] for p in shared]
        else:
            results[name] = greedy(llm, others[:8] + shared + others[8:])[8:40]
        llm.shutdown()
        del llm
    reference = results[SETTINGS[0][0]]
    answers = logprobs = 0
    largest = 0.0
    for i, want in enumerate(reference):
        got = [results[name][i] for name, *_ in SETTINGS[1:]]
        answers += any(g[0] != want[0] for g in got)
        logprobs += any(g[1] != want[1] for g in got)
        for g in got:
            if g[0] == want[0]:
                largest = max([largest, *(abs(a - b) for a, b in zip(g[1], want[1]))])
    print(f"{mode}: answers differ {answers}/32, logprobs {logprobs}/32, max {largest:.2e}")
    return {
        ANSWERS: answers,
        LOGPROBS: logprobs,
        LARGEST: round(largest, 5),
    }


WORKLOADS = {  # name: (prompts, prompt length range, output length range, what is counted)
    "prefill": (4, (1024, 1024), (1, 1), "prompt"),
    "decode c16": (16, (64, 64), (64, 64), "output"),
    "mixed": (16, (20, 600), (16, 64), "total"),
}


def cost_rows(model: str | None, rounds: int) -> dict[str, dict]:
    engines = {
        mode: engine(model, invariant, enable_prefix_caching=False)
        for mode, invariant in MODES.items()
    }
    vocab = engines["default"].get_tokenizer().vocab_size
    best: dict[tuple[str, str], float] = {}
    for round_index in range(rounds):
        order = list(MODES) if round_index % 2 == 0 else list(MODES)[::-1]
        for name, (num, prompt_len, output_len, counted) in WORKLOADS.items():
            rng = random.Random(1)
            work = [
                ([rng.randrange(1000, vocab) for _ in range(rng.randint(*prompt_len))], out)
                for out in (rng.randint(*output_len) for _ in range(num))
            ]
            for mode in order:
                rate = throughput(engines[mode], work, counted)
                best[mode, name] = max(best.get((mode, name), 0.0), rate)
                print(f"round {round_index} {name} {mode}: {rate:.1f} tok/s", flush=True)
    rows = {}
    for name in WORKLOADS:
        default, invariant = best["default", name], best["--batch-invariant", name]
        rows[f"{name}, {WORKLOADS[name][3]} tokens"] = {
            "default": round(default, 1),
            "--batch-invariant": round(invariant, 1),
            "default / invariant": round(default / invariant, 2),
        }
    for llm in engines.values():
        llm.shutdown()
    return rows


def throughput(llm: LLM, work: list[tuple[list[int], int]], counted: str) -> float:
    params = [SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0) for _, out in work]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    prompt, output = sum(len(p) for p, _ in work), sum(out for _, out in work)
    return {"prompt": prompt, "output": output, "total": prompt + output}[counted] / seconds


def write_record(args, rows: dict[str, dict]) -> None:
    from tokenbus.bench.record import make_record, this_command, write_record

    entry = make_record(
        "batch_invariance",
        this_command(),
        rows,
        units={
            **{f"{name}, {counted} tokens": "tok/s" for name, (*_, counted) in WORKLOADS.items()},
            LARGEST: "nats",
            "default / invariant": "×",
        },
        peers=["the same engine without --batch-invariant, alternated"],
        variant=f"{args.model or 'SmolLM2'}, best of {args.rounds} rounds",
    )
    write_record(args.record, entry)


if __name__ == "__main__":
    main()
