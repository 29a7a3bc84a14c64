"""Stat loggers: Prometheus metrics and a periodic log line (L5).

The engine front end calls `record(scheduler_stats, iteration_stats)` after each step's outputs.
Metric names are vLLM's with our prefix (`vllm:num_requests_running` → `tokenbus:num_requests_running`)
so existing dashboards and autoscalers need only the prefix changed. Each logger owns its
metrics in a registry it is given: no process-global state, several servers per process work.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("tokenbus.stats")

PREFIX = "tokenbus:"
FINISH_REASONS = ("stop", "length", "abort", "error")
# Buckets as in vLLM's PrometheusStatLogger.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


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
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 engine_index: int = 0) -> None:
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        names = list(self.labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, names, registry=registry).labels(**self.labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, names, registry=registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=registry).labels(**self.labels)

        self.running = gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        # Accepted drafts by position in the draft (vLLM's ..._per_pos): the acceptance rate at
        # position j is accepted_per_pos{position=j} / num_drafts.
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            names + ["position"], registry=registry)
        success = Counter(PREFIX + "request_success", "Count of finished requests by reason.",
                          names + ["finished_reason"], registry=registry)
        self.success = {r: success.labels(**self.labels, finished_reason=r) for r in FINISH_REASONS}
        self._success_family = success
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time spent waiting in seconds.",
                                    LATENCY_BUCKETS)
        size_buckets = token_buckets(max_model_len)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", size_buckets)
        self.request_generation = histogram("request_generation_tokens", "Generated tokens per request.",
                                            size_buckets)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self.record_iteration(iteration_stats)

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
            self.spec_accepted_per_pos.labels(**self.labels, position=str(position)).inc(accepted)

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
                self.success[reason] = self._success_family.labels(**self.labels, finished_reason=reason)
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
        self._last_stats: Any = None
        self._was_idle = False

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self._last_stats = scheduler_stats
            self._prefix_queries += scheduler_stats.prefix_cache_queries
            self._prefix_hits += scheduler_stats.prefix_cache_hits
        if iteration_stats is not None:
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> str | None:
        """Log and return the line for the interval since the last call; quiet when idle twice."""
        now = self._clock()
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self._last_stats
        running = stats.num_running_reqs if stats else 0
        waiting = stats.num_waiting_reqs if stats else 0
        is_idle = not (self._num_prompt_tokens or self._num_generation_tokens or running or waiting)
        hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
        line = (f"Avg prompt throughput: {self._num_prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._num_generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * (stats.kv_cache_usage if stats else 0.0):.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
        self._last_log_time = now
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._prefix_queries = self._prefix_hits = 0
        should_log = not (is_idle and self._was_idle)
        self._was_idle = is_idle
        if should_log:
            logger.info(line)
        return line if should_log else None
