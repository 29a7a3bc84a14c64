"""Per-batch serving statistics and the stat-logger interface (L4, front end).

The EngineCore reports `SchedulerStats` (queues, KV usage, per-step counters) with each step;
the front end adds what only it can time — first tokens, gaps between tokens, whole-request
latencies — as one `IterationStats` per batch of engine outputs. Both go to every `StatLogger`
(Prometheus, periodic log lines: see api/openai).

All times are wall-clock seconds (time.time()), the clock of EngineRequest.arrival_time and of
EngineOutput.first_scheduled_time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenbus.protocol import EngineOutput, SchedulerStats


@dataclass
class FinishedRequestStats:
    """One engine request (one of a parent's n children) that finished or was aborted."""

    finish_reason: str  # "stop", "length", "abort", "error"
    e2e_latency_s: float  # arrival → finish
    queue_time_s: float  # arrival → first scheduled (→ finish when never scheduled)
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of engine outputs did, seen from the front end."""

    timestamp: float
    num_prompt_tokens: int = 0  # prompts of the requests that got their first token here
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)  # one per request output
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Called once per batch of engine outputs. `scheduler_stats` is the engine's report of
        one step (its counters are per step: add them up) or None; `engine_index` says which
        data-parallel engine sent them."""


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float = 0.0
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Per engine request, the times IterationStats are computed from. Keyed like the engine
    (child request ids); requests it does not know (already aborted) are ignored."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}
        # Aborted between batches: reported with the next batch.
        self._pending_finished: list[FinishedRequestStats] = []

    def add_request(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens)

    def update(self, outputs: list[EngineOutput], now: float) -> IterationStats:
        """Count the tokens and latencies of one batch (call before its requests finish)."""
        stats = IterationStats(timestamp=now, finished_requests=self._pending_finished)
        self._pending_finished = []
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if output.first_scheduled_time:
                times.first_scheduled_time = output.first_scheduled_time
            if not output.new_token_ids:
                continue
            stats.num_generation_tokens += len(output.new_token_ids)
            if times.num_generation_tokens == 0:
                stats.num_prompt_tokens += times.num_prompt_tokens
                stats.time_to_first_tokens_s.append(now - times.arrival_time)
            else:
                stats.inter_token_latencies_s.append(now - times.last_token_time)
            times.last_token_time = now
            times.num_generation_tokens += len(output.new_token_ids)
        return stats

    def finish(
        self, request_id: str, finish_reason: str, now: float, stats: IterationStats
    ) -> None:
        times = self._requests.pop(request_id, None)
        if times is not None:
            stats.finished_requests.append(_finished(times, finish_reason, now))

    def abort(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            times = self._requests.pop(request_id, None)
            if times is not None:
                self._pending_finished.append(_finished(times, "abort", now))


def _finished(times: _RequestTimes, finish_reason: str, now: float) -> FinishedRequestStats:
    scheduled = times.first_scheduled_time or now
    return FinishedRequestStats(
        finish_reason=finish_reason,
        e2e_latency_s=now - times.arrival_time,
        queue_time_s=max(0.0, scheduled - times.arrival_time),
        num_prompt_tokens=times.num_prompt_tokens,
        num_generation_tokens=times.num_generation_tokens,
    )
