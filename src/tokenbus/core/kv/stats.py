"""Prefix-cache counters, read by the engine's metrics (named like vLLM's PrefixCacheStats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups over an interval (or since start-up, for the cumulative copy).

    ``queries`` and ``hits`` count tokens. Lookups of requests resumed after a preemption are
    counted apart (``preempted_*``): re-hitting their own freed blocks would inflate the hit
    rate (vllm#25780).
    """

    reset: bool = False  # reset_prefix_cache() succeeded during the interval
    requests: int = 0  # lookups of requests never preempted
    queries: int = 0  # their tokens looked up
    hits: int = 0  # their tokens found in the cache
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_queried_tokens: int, num_hit_tokens: int, is_preempted: bool) -> None:
        if is_preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_queried_tokens
            self.preempted_hits += num_hit_tokens
        else:
            self.requests += 1
            self.queries += num_queried_tokens
            self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """hits / queries of first-time lookups; 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0
