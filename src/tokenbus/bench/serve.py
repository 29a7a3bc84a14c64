"""Online serving benchmark: a load generator for any OpenAI-compatible server (L6).

Streams `/v1/completions` requests from a seeded dataset at a Poisson (gamma) request rate,
under an optional concurrency cap, and measures on the client side as `vllm bench serve` does:

    TTFT  = first streamed token − send
    ITL   = gaps between successive streamed chunks
    TPOT  = (E2E − TTFT) / (output tokens − 1)
    E2E   = last chunk − send

and prints vLLM's "Serving Benchmark Result" table. Only loopback servers are accepted: this
is a benchmark for this machine, not a load tool aimed at someone else's service.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tokenbus.bench.datasets import BenchRequest

MAX_NUM_PROMPTS = 100_000
BANNER_WIDTH = 50


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson arrivals
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    percentiles: tuple[float, ...] = (50.0, 99.0)

    def __post_init__(self) -> None:
        check_loopback(self.base_url)
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class ServeRequest:
    """One request to send: a text prompt or token ids, and how many tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    prompt_len: int
    output_len_requested: int
    success: bool = False
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)  # since benchmark start
    error: str = ""


def check_loopback(url: str) -> None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"base_url: expected http(s)://host:port, got {url!r}")
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(
        f"base_url: only loopback servers (127.0.0.1, ::1, localhost) may be "
        f"benchmarked, got host {host!r}"
    )


def requests_from_workload(
    workload: list[BenchRequest], tokenizer: Any | None = None
) -> list[ServeRequest]:
    """Token-id prompts, or text decoded from them when a tokenizer is given (for servers that
    take only text); the text's own token count is then the prompt length."""
    result = []
    for item in workload:
        if tokenizer is None:
            result.append(
                ServeRequest(item.prompt_token_ids, len(item.prompt_token_ids), item.output_len)
            )
        else:
            text = tokenizer.decode(item.prompt_token_ids)
            result.append(
                ServeRequest(
                    text, len(tokenizer.encode(text, add_special_tokens=False)), item.output_len
                )
            )
    return result


def requests_from_jsonl(path: str, num_prompts: int, default_output_len: int) -> list[ServeRequest]:
    """Lines of {"prompt": str | [ids], "output_len" (or "max_tokens"): int}; prompt lengths
    are taken from the server's usage report."""
    result = []
    with open(path) as f:
        for line in f:
            if line.strip() and len(result) < num_prompts:
                item = json.loads(line)
                output_len = int(item.get("output_len", item.get("max_tokens", default_output_len)))
                prompt = item["prompt"]
                result.append(
                    ServeRequest(prompt, len(prompt) if isinstance(prompt, list) else 0, output_len)
                )
    if not result:
        raise ValueError(f"dataset {path!r} holds no prompts")
    return result


def arrival_delays(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness, scale=1/(rate*burstiness)), as vLLM."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num_requests)]


async def fetch_model_name(session: aiohttp.ClientSession, config: ServeBenchConfig) -> str:
    async with session.get(config.base_url.rstrip("/") + "/v1/models") as response:
        response.raise_for_status()
        models = (await response.json())["data"]
    if not models:
        raise ValueError("the server lists no models; pass --model")
    return models[0]["id"]


async def _sse_payloads(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(
    session: aiohttp.ClientSession,
    config: ServeBenchConfig,
    model: str,
    request: ServeRequest,
    bench_start: float,
) -> RequestResult:
    payload = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if (
        config.ignore_eos
    ):  # an extension: some servers (HF transformers serve) refuse unknown fields
        payload["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    result = RequestResult(request.prompt_len, request.output_len)
    url = config.base_url.rstrip("/") + config.endpoint
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for chunk in _sse_payloads(response):
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get(
                        "completion_tokens", result.output_tokens
                    )
                    result.prompt_len = chunk["usage"].get("prompt_tokens", result.prompt_len)
                if not carries_tokens(chunk):
                    continue
                if not result.chunk_times_s:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                result.chunk_times_s.append(now - bench_start)
                last = now
        result.latency_s = last - start
        result.output_tokens = result.output_tokens or len(result.chunk_times_s)
        result.success = bool(result.chunk_times_s)
        result.error = "" if result.success else "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def carries_tokens(chunk: dict[str, Any]) -> bool:
    """Whether a streamed completion chunk brings tokens: text, or no text yet (bytes of an
    unfinished character, or ids the tokenizer cannot spell: a dummy model's wider vocab). An
    empty chunk that only finishes brings none, nor does a usage chunk (no choices)."""
    return any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices", []))


async def run_benchmark(config: ServeBenchConfig, requests: list[ServeRequest]) -> dict[str, Any]:
    if not 1 <= len(requests) <= MAX_NUM_PROMPTS:
        raise ValueError(
            f"num_prompts must be between 1 and {MAX_NUM_PROMPTS}, got {len(requests)}"
        )
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await fetch_model_name(session, config)
        probe = await send_request(
            session,
            config,
            model,
            ServeRequest(requests[0].prompt, requests[0].prompt_len, 2),
            time.perf_counter(),
        )
        if not probe.success:
            raise RuntimeError(f"the test request failed: {probe.error}")
        results, duration, peak = await _run_all(session, config, model, requests)
    return summarize(results, duration, peak, config, model)


async def _run_all(
    session: aiohttp.ClientSession,
    config: ServeBenchConfig,
    model: str,
    requests: list[ServeRequest],
) -> tuple[list[RequestResult], float, int]:
    semaphore = asyncio.Semaphore(config.max_concurrency or len(requests))
    in_flight = peak = 0
    start = time.perf_counter()

    async def one(request: ServeRequest) -> RequestResult:
        nonlocal in_flight, peak
        async with semaphore:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(session, config, model, request, start)
            finally:
                in_flight -= 1

    tasks = []
    for request, delay in zip(
        requests, arrival_delays(len(requests), config.request_rate, config.burstiness, config.seed)
    ):
        await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, peak


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = sorted(v * 1000.0 for v in values_s) or [0.0]
    stats = {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
    }
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = _percentile(ms, p)
    return stats


def _percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    k = (len(sorted_values) - 1) * p / 100.0
    low, high = math.floor(k), math.ceil(k)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (k - low)


def _peak_output_throughput(results: list[RequestResult]) -> float:
    buckets: dict[int, int] = {}
    for r in results:
        for t in r.chunk_times_s:
            buckets[int(t)] = buckets.get(int(t), 0) + 1
    return float(max(buckets.values(), default=0))


def summarize(
    results: list[RequestResult],
    duration_s: float,
    peak_concurrency: int,
    config: ServeBenchConfig,
    model: str,
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "model": model,
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "peak_output_throughput": _peak_output_throughput(ok),
        "peak_concurrent_requests": peak_concurrency,
    }
    summary |= _stats("ttft", [r.ttft_s for r in ok], config.percentiles)
    summary |= _stats("tpot", tpots, config.percentiles)
    summary |= _stats("itl", [itl for r in ok for itl in r.itls_s], config.percentiles)
    summary |= _stats("e2el", [r.latency_s for r in ok], config.percentiles)
    summary["input_lens"] = [r.prompt_len for r in results]
    summary["output_lens"] = [r.output_tokens for r in results]
    summary["ttfts"] = [r.ttft_s for r in results]
    summary["itls"] = [r.itls_s for r in results]
    summary["errors"] = [r.error for r in results]
    return summary


def format_report(summary: dict[str, Any], percentiles: tuple[float, ...] = (99.0,)) -> str:
    """vLLM's table; `percentiles` are shown after mean and median."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=BANNER_WIDTH, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{fmt}}".format(label, value, fmt=fmt))

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if summary["max_concurrency"] is not None:
        row("Maximum request concurrency:", summary["max_concurrency"])
    if summary["request_rate"] != "inf":
        row("Request rate configured (RPS):", summary["request_rate"], ".2f")
    row("Benchmark duration (s):", summary["duration"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", summary["peak_output_throughput"], ".2f")
    row("Peak concurrent requests:", summary["peak_concurrent_requests"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    sections = (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
    )
    for key, short, title in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=BANNER_WIDTH, c="-"))
        row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", summary[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", summary.get(f"p{p:g}_{key}_ms", float("nan")), ".2f")
    lines.append("=" * BANNER_WIDTH)
    return "\n".join(lines)


def config_dict(config: ServeBenchConfig) -> dict[str, Any]:
    data = asdict(config)
    data.pop("api_key", None)  # never write a secret into a result file
    data["request_rate"] = config.request_rate if math.isfinite(config.request_rate) else "inf"
    return data
