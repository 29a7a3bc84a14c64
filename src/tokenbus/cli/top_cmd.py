"""`tokenbus top`: the /xray snapshot of a running server in the terminal (L7).

Polls GET /xray/snapshot and redraws: per engine, the block pool as one character per block,
the last steps as a sparkline of tokens per step, and a row per request.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time

import httpx

BLOCK_CHARS = " .c#@"  # by BlockState: null, free, cached-and-free, used, shared
SPARKS = " ▁▂▃▄▅▆▇█"


def add_top_parser(sub) -> None:
    top = sub.add_parser("top", help="watch a running server's scheduler and KV cache")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    top.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"))
    top.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.set_defaults(func=_top)


def _top(ns: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    url = ns.url.rstrip("/") + "/xray/snapshot"
    with httpx.Client(headers=headers, timeout=10.0) as client:
        while True:
            response = client.get(url)
            if response.status_code != 200:
                print(f"error: {url}: HTTP {response.status_code}", file=sys.stderr)
                return 1
            width = os.get_terminal_size().columns if sys.stdout.isatty() else 100
            text = render(response.json(), width)
            if ns.once:
                print(text)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")  # home, clear, redraw
            sys.stdout.flush()
            time.sleep(ns.interval)


def render(data: dict, width: int = 100) -> str:
    lines = [f"tokenbus top · {data['model']} · {time.strftime('%H:%M:%S')}"]
    for snap in data["engines"]:
        lines += ["", *_render_engine(snap, max(width, 40))]
    return "\n".join(lines)


def _render_engine(snap: dict, width: int) -> list[str]:
    states = base64.b64decode(snap["block_states"])
    counts = [states.count(bytes([s])) for s in range(len(BLOCK_CHARS))]
    steps = snap["steps"]
    last = steps[-1] if steps else None
    head = f"engine {snap['engine_index']} · step {snap['step_index']}"
    if last:
        head += f" · last step {last['duration_ms']:.1f} ms, {last['num_reqs']} requests"
    in_use, shared, cached, free = counts[3] + counts[4], counts[4], counts[2], counts[1]
    lines = [
        head,
        f"blocks: {snap['num_blocks']} × {snap['block_size']} tokens · in use {in_use}"
        f" (shared {shared}) · cached {cached} · free {free}"
        "   [. free  c cached  # used  @ shared]",
    ]
    pool = "".join(BLOCK_CHARS[s] for s in states)
    for start in range(0, min(len(pool), width * 8), width):  # at most 8 rows
        lines.append(pool[start : start + width])
    if steps:
        totals = [s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps[-width:]]
        peak = max(max(totals), 1)
        spark = "".join(SPARKS[round(t / peak * (len(SPARKS) - 1))] for t in totals)
        lines.append(f"tokens per step (max {peak}):")
        lines.append(spark)
    lines.append(
        f"{'request':<24}{'status':<12}{'prompt':>7}{'gen':>6}{'computed':>9}{'hit':>6}"
        f"{'pre':>4}  blocks"
    )
    for r in snap["requests"][:20]:
        ids = " ".join(map(str, r["block_ids"]))
        row = (
            f"{r['request_id'][:23]:<24}{r['status'][:11]:<12}{r['num_prompt_tokens']:>7}"
            f"{r['num_output_tokens']:>6}{r['num_computed_tokens']:>9}"
            f"{r['num_cached_tokens']:>6}{r['num_preemptions']:>4}  "
        )
        lines.append(row + ids[: max(width - len(row), 24)])
    if snap["num_requests"] > 20:
        lines.append(f"… {snap['num_requests'] - 20} more requests")
    return lines
