"""Cache-aware data-parallel routing on multi-turn chats: TTFT and prefix-cache hits by routing.

One `tokenbus serve --data-parallel-size 2 --num-threads 1` (the default model unless --model)
per round, started afresh (cold caches) with `--data-parallel-routing` set to each mode in turn,
the order alternating from round to round (a shared machine drifts). The workload is the same
every time: --conversations chats, --concurrency of them at once, each of --turns turns with a
--think pause before each next one (a user reading and typing); a turn's prompt is the whole
chat so far (a shared system prompt, a long first message, the replies and shorter
follow-ups), streamed, greedy, --max-tokens each. TTFT p50 pools every turn of every round of a
mode; the hit rate is the prefix-cache hits over the lookups, in tokens, summed over both
engines' /metrics for the measured requests; "all chats" is the median over rounds of the
seconds the whole workload took.

    .venv/bin/python benchmarks/dp_routing.py [--rounds 2] [--record DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from tokenbus.bench.server_wait import wait_healthy  # noqa: E402 - after the path

BIN = os.path.join(os.path.dirname(sys.executable), "tokenbus")
WORDS = tuple(
    (
        "the a of engine cache block token prompt model batch step queue page memory request "
        "reply turn chat user system answer question data value table report month sales region "
        "team plan budget risk task review draft summary detail number list order price customer "
        "product service update change issue result test build release week day hour note goal "
        "score rate share growth cost time team north south east west first second last next"
    ).split()
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--modes", default="prefix,least_loaded,round_robin")
    parser.add_argument("--rounds", type=int, default=2, help="servers started per mode")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=60)
    parser.add_argument("--first-words", type=int, default=400)
    parser.add_argument("--turn-words", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--think",
        type=float,
        nargs=2,
        default=(0.0, 0.0),
        metavar=("MIN", "MAX"),
        help="seconds a chat pauses between turns, drawn per turn (seeded)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", default=None, metavar="DIR")
    args = parser.parse_args()
    modes = args.modes.split(",")
    chats = make_chats(args)
    ttfts: dict[str, list[float]] = {mode: [] for mode in modes}
    hits: dict[str, list[float]] = {mode: [0.0, 0.0] for mode in modes}  # hits, lookups
    splits: dict[str, list[str]] = {mode: [] for mode in modes}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            result = run_round(args, mode, chats)
            ttfts[mode] += result["ttfts"]
            hits[mode][0] += result["hits"]
            hits[mode][1] += result["queries"]
            splits[mode].append(result["split"])
            seconds[mode].append(result["seconds"])
            print(
                f"round {round_index} {mode}: TTFT p50 {1e3 * median(result['ttfts']):.0f} ms, "
                f"hit rate {result['hits'] / max(result['queries'], 1):.3f}, "
                f"requests per engine {result['split']}, {result['seconds']:.1f} s",
                flush=True,
            )
    summary = {
        mode: {
            "TTFT p50": round(1e3 * median(ttfts[mode]), 1),
            "TTFT p90": round(1e3 * quantile(ttfts[mode], 0.9), 1),
            "prefix hit rate": round(hits[mode][0] / max(hits[mode][1], 1), 3),
            "all chats, median": round(median(seconds[mode]), 1),
            "requests per engine": " ".join(splits[mode]),
        }
        for mode in modes
    }
    base = summary[modes[-1]]["TTFT p50"]
    for mode in modes:
        summary[mode][f"TTFT p50 / {modes[-1]}"] = round(summary[mode]["TTFT p50"] / base, 3)
    print(json.dumps(summary, indent=1))
    if args.record:
        write_record(args, modes, summary)


def make_chats(args) -> list[dict]:
    """Each chat: a system prompt shared by all, a long first message, shorter follow-ups."""
    rng = random.Random(args.seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    system = "You are a careful analyst. Context: " + text(args.system_words)
    return [
        {
            "system": system,
            "first": f"Read this report ({i}) and answer in short: " + text(args.first_words),
            "follow_ups": [f"Next ({t}): " + text(args.turn_words) for t in range(args.turns - 1)],
            "pauses": [rng.uniform(*args.think) for _ in range(args.turns - 1)],
        }
        for i in range(args.conversations)
    ]


def run_round(args, mode: str, chats: list[dict]) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="tokenbus-dp-routing-", suffix=".log")
    command = [BIN, "serve", *([args.model] if args.model else []), "--port", str(args.port)]
    command += ["--data-parallel-size", "2", "--num-threads", "1"]
    command += ["--data-parallel-routing", mode]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, log)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        with ThreadPoolExecutor(2) as pool:  # one short request per engine, unmeasured
            list(pool.map(lambda i: turn(url, model, warm_up(i), 4), range(2)))
        before = httpx.get(url + "/metrics", timeout=10).text
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            per_chat = list(pool.map(lambda chat: converse(url, model, chat, args), chats))
        seconds = time.perf_counter() - start
        after = httpx.get(url + "/metrics", timeout=10).text
    finally:
        server.terminate()
        server.wait(60)
        log.close()

    def delta(name: str, engine: int) -> float:
        return engine_counter(after, name, engine) - engine_counter(before, name, engine)

    requests = [delta("generation_tokens", e) / args.max_tokens for e in (0, 1)]
    return {
        "ttfts": [t for chat in per_chat for t in chat],
        "seconds": seconds,
        "hits": sum(delta("prefix_cache_hits", e) for e in (0, 1)),
        "queries": sum(delta("prefix_cache_queries", e) for e in (0, 1)),
        "split": "/".join(f"{r:.0f}" for r in requests),
    }


def warm_up(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Say hello ({i})."}]


def converse(url: str, model: str, chat: dict, args) -> list[float]:
    """One chat, turn after turn; the TTFT of each turn."""
    messages = [
        {"role": "system", "content": chat["system"]},
        {"role": "user", "content": chat["first"]},
    ]
    ttfts = []
    for index, follow_up in enumerate([*chat["follow_ups"], None]):
        ttft, reply = turn(url, model, messages, args.max_tokens)
        ttfts.append(ttft)
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": follow_up},
            ]
            time.sleep(chat["pauses"][index])
    return ttfts


def turn(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(content)
    if ttft is None:
        raise RuntimeError("a turn streamed no content")
    return ttft, "".join(parts)


def engine_counter(metrics: str, name: str, engine: int) -> float:
    match = re.search(
        rf'^tokenbus:{name}_total{{engine="{engine}",[^}}]*}} (\S+)$', metrics, re.MULTILINE
    )
    if match is None:
        raise KeyError(f"{name} of engine {engine}")
    return float(match.group(1))


def median(values: list[float]) -> float:
    return statistics.median(values)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_record(args, modes: list[str], summary: dict) -> None:
    from tokenbus.bench.record import make_record, this_command, write_record

    ratio = f"TTFT p50 / {modes[-1]}"
    entry = make_record(
        "dp_routing",
        this_command(),
        {f"--data-parallel-routing {mode}": summary[mode] for mode in modes},
        units={"TTFT p50": "ms", "TTFT p90": "ms", "all chats, median": "s", ratio: "×"},
        peers=[f"--data-parallel-routing {mode}" for mode in modes[1:]] + ["alternated"],
        variant=(
            f"{args.model or 'SmolLM2 (default)'}, DP 2 × 1 thread; {args.conversations} "
            f"chats × {args.turns} turns, {args.concurrency} at once, "
            f"{args.think[0]:g}-{args.think[1]:g} s between turns; {args.rounds} rounds"
        ),
    )
    write_record(args.record, entry)


if __name__ == "__main__":
    main()
