"""Stat loggers: Prometheus metrics and a periodic log line (L5).

The engine front end calls `record(scheduler_stats, iteration_stats, engine_index)` after each
step's outputs (engine_index: which data-parallel engine they came from).
Metric names are vLLM's with our prefix (`vllm:num_requests_running` →
`tokenbus:num_requests_running`) so existing dashboards and autoscalers need only the prefix
changed. Each logger owns its metrics in a registry it is given: no process-global state, several
servers per process work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("tokenbus.stats")

PREFIX = "tokenbus:"
FINISH_REASONS = ("stop", "length", "abort", "error")
# Buckets as in vLLM's PrometheusStatLogger.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


class PrometheusStatLogger:
    """One set of metric families; each engine (data parallelism) gets its own series under
    the `engine` label, exported from the start (an idle server already shows its gauges)."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, max_model_len: int, num_engines: int = 1
    ) -> None:
        self.model_name = model_name
        names = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, names + list(extra), registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=registry)

        size_buckets = token_buckets(max_model_len)
        # attribute → family; _EngineSeries holds each family's child for one engine.
        self.families: dict[str, Any] = {
            "running": gauge("num_requests_running", "Requests in model execution batches."),
            "waiting": gauge("num_requests_waiting", "Requests waiting to be processed."),
            "kv_usage": gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            "prefix_queries": counter("prefix_cache_queries", "Prefix cache queries, in tokens."),
            "prefix_hits": counter("prefix_cache_hits", "Prefix cache hits, in tokens."),
            "preemptions": counter("num_preemptions", "Cumulative number of preemptions."),
            "prompt_tokens": counter("prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": counter(
                "generation_tokens", "Number of generation tokens processed."
            ),
            "spec_drafts": counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
            "spec_draft_tokens": counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
            "spec_accepted": counter(
                "spec_decode_num_accepted_tokens", "Number of accepted tokens."
            ),
            "external_queries": counter(
                "external_prefix_cache_queries",
                "External prefix cache queries (KV connector), in tokens.",
            ),
            "external_hits": counter(
                "external_prefix_cache_hits",
                "External prefix cache hits (KV connector), in tokens.",
            ),
            "kv_bytes_loaded": counter(
                "kv_transfer_loaded_bytes", "K/V bytes a KV connector loaded."
            ),
            "kv_bytes_saved": counter(
                "kv_transfer_saved_bytes", "K/V bytes a KV connector saved or sent."
            ),
            "kv_load_seconds": counter(
                "kv_transfer_load_seconds", "Seconds a KV connector spent loading."
            ),
            "kv_save_seconds": counter(
                "kv_transfer_save_seconds", "Seconds a KV connector spent saving."
            ),
            "ttft": histogram(
                "time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
            ),
            "itl": histogram(
                "inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
            ),
            "e2e": histogram(
                "e2e_request_latency_seconds",
                "End-to-end request latency in seconds.",
                LATENCY_BUCKETS,
            ),
            "queue_time": histogram(
                "request_queue_time_seconds", "Time spent waiting in seconds.", LATENCY_BUCKETS
            ),
            "request_prompt": histogram(
                "request_prompt_tokens", "Prompt tokens per request.", size_buckets
            ),
            "request_generation": histogram(
                "request_generation_tokens", "Generated tokens per request.", size_buckets
            ),
        }
        # Accepted drafts by position in the draft (vLLM's ..._per_pos): the acceptance rate at
        # position j is accepted_per_pos{position=j} / num_drafts.
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ("position",),
        )
        # Bytes held by each tier of a KV connector's store (OffloadingConnector: cpu, disk).
        self.kv_tier_bytes = Gauge(
            PREFIX + "kv_offload_tier_bytes",
            "Bytes of K/V held by each offload tier.",
            names + ["tier"],
            registry=registry,
        )
        self.success = counter(
            "request_success", "Count of finished requests by reason.", ("finished_reason",)
        )
        self._engines: dict[int, _EngineSeries] = {}
        for index in range(num_engines):
            self.engine(index)

    def engine(self, index: int) -> _EngineSeries:
        if index not in self._engines:
            labels = {"model_name": self.model_name, "engine": str(index)}
            children = {name: family.labels(**labels) for name, family in self.families.items()}
            self._engines[index] = _EngineSeries(
                labels, children, self.spec_accepted_per_pos, self.success, self.kv_tier_bytes
            )
        return self._engines[index]

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_index: int = 0) -> None:
        series = self.engine(engine_index)
        if scheduler_stats is not None:
            series.record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            series.record_iteration(iteration_stats)


class _EngineSeries:
    """The series of one engine (its `engine` label)."""

    def __init__(
        self,
        labels: dict[str, str],
        children: dict[str, Any],
        per_pos: Counter,
        success: Counter,
        tier_bytes: Gauge,
    ) -> None:
        self.labels = labels
        self._tier_bytes = tier_bytes
        for name, child in children.items():
            setattr(self, name, child)
        self._per_pos = per_pos
        self._success_family = success
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}

    def record_scheduler(self, stats: Any) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.preemptions.inc(stats.num_preemptions)
        self.spec_drafts.inc(getattr(stats, "spec_num_drafts", 0))
        self.spec_draft_tokens.inc(getattr(stats, "spec_num_draft_tokens", 0))
        self.spec_accepted.inc(getattr(stats, "spec_num_accepted_tokens", 0))
        for position, accepted in enumerate(getattr(stats, "spec_accepted_per_pos", None) or []):
            self._per_pos.labels(**self.labels, position=str(position)).inc(accepted)
        self.external_queries.inc(getattr(stats, "external_prefix_cache_queries", 0))
        self.external_hits.inc(getattr(stats, "external_prefix_cache_hits", 0))
        self.kv_bytes_loaded.inc(getattr(stats, "kv_bytes_loaded", 0))
        self.kv_bytes_saved.inc(getattr(stats, "kv_bytes_saved", 0))
        self.kv_load_seconds.inc(getattr(stats, "kv_load_seconds", 0.0))
        self.kv_save_seconds.inc(getattr(stats, "kv_save_seconds", 0.0))
        for tier, num_bytes in (getattr(stats, "kv_tier_bytes", None) or {}).items():
            self._tier_bytes.labels(**self.labels, tier=tier).set(num_bytes)

    def record_iteration(self, stats: Any) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens_s:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies_s:
            self.itl.observe(value)
        for finished in stats.finished_requests:
            reason = str(finished.finish_reason)
            if reason not in self.success:
                self.success[reason] = self._success_family.labels(
                    **self.labels, finished_reason=reason
                )
            self.success[reason].inc()
            self.e2e.observe(finished.e2e_latency_s)
            self.queue_time.observe(finished.queue_time_s)
            self.request_prompt.observe(finished.num_prompt_tokens)
            self.request_generation.observe(finished.num_generation_tokens)


class LoggingStatLogger:
    """Accumulates between calls to `log`, which the server makes every few seconds:

    Avg prompt throughput: 210.3 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 41.0%
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_log_time = clock()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._last_stats: dict[int, Any] = {}  # engine index → its last scheduler stats
        self._was_idle = False

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_index: int = 0) -> None:
        if scheduler_stats is not None:
            self._last_stats[engine_index] = scheduler_stats
            self._prefix_queries += scheduler_stats.prefix_cache_queries
            self._prefix_hits += scheduler_stats.prefix_cache_hits
        if iteration_stats is not None:
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> str | None:
        """Log and return the line for the interval since the last call; quiet when idle twice."""
        now = self._clock()
        elapsed = max(now - self._last_log_time, 1e-9)
        # Summed over data-parallel engines; KV usage is their mean (each has its own pool).
        engines = list(self._last_stats.values())
        running = sum(s.num_running_reqs for s in engines)
        waiting = sum(s.num_waiting_reqs for s in engines)
        kv_usage = sum(s.kv_cache_usage for s in engines) / len(engines) if engines else 0.0
        is_idle = not (self._num_prompt_tokens or self._num_generation_tokens or running or waiting)
        hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
        line = (
            f"Avg prompt throughput: {self._num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * kv_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%"
        )
        self._last_log_time = now
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._prefix_queries = self._prefix_hits = 0
        should_log = not (is_idle and self._was_idle)
        self._was_idle = is_idle
        if should_log:
            logger.info(line)
        return line if should_log else None
