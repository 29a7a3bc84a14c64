"""The engine's X-ray: per-step records and snapshots of the scheduler and block pool (L1).

The EngineCore owns one recorder. Every step it notes what the step scheduled (a few ints in a
ring of the last `max_steps`); a snapshot (block states, request rows, the ring) is built only
while a viewer watches, and at most once per `interval` seconds, so an unwatched engine pays
almost nothing. Everything is read from the scheduler's own state; nothing here changes it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.core.sched.scheduler import Scheduler
from tokenbus.protocol import BlockState, XrayRequest, XraySnapshot, XrayStep

MAX_FREE_ORDER = 4096  # free-queue entries sent (the head: evicted next)
MAX_REQUEST_ROWS = 256  # request rows sent; the rest are counted
MAX_ROW_BLOCK_IDS = 512  # block ids sent per request row; XrayRequest.num_blocks counts them all
# At most this share of the engine's time goes to building snapshots: a big pool (a GPU's tens
# of thousands of blocks) is drawn less often rather than slowing the steps.
MAX_TIME_SHARE = 0.02

_STATUS_NAMES = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.WAITING_FOR_GRAMMAR: "waiting_for_grammar",
    RequestStatus.WAITING_FOR_REMOTE_KVS: "loading_kv",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}


@dataclass
class _SpecCounts:
    drafted: int = 0
    accepted: int = 0


class XrayRecorder:
    def __init__(self, scheduler: Scheduler, max_steps: int = 240, interval: float = 0.25) -> None:
        self.scheduler = scheduler
        self.interval = interval
        self.steps: deque[XrayStep] = deque(maxlen=max_steps)
        self.num_steps = 0
        self._watch_until = 0.0  # monotonic deadline of the current viewer's interest
        self._last_snapshot = 0.0
        self._last: XraySnapshot | None = None
        self._build_seconds = 0.0  # what the last snapshot took to build
        self._spec: dict[str, _SpecCounts] = {}  # only requests that drafted
        self._last_read = 0.0  # perf_counter when the last step's output was read

    # ------------------------------------------------------------------ per step
    def begin_step(self, so: SchedulerOutput) -> tuple[float, int, int]:
        """Right after schedule(): (start time, prefill tokens, decode tokens) of the step.

        schedule() has already advanced num_computed_tokens by the step's tokens and counted
        the token it samples as a placeholder, so a request was generating when it had computed
        all but its last token, known or unread (drafts come on top), and has sampled before."""
        prefill = decode = 0
        requests = self.scheduler.requests
        for req_id, num_new in so.num_scheduled_tokens.items():
            request = requests[req_id]
            computed_before = request.num_computed_tokens - num_new
            unread = request.num_output_placeholders - 1  # before this step's own; -1: none
            last = request.num_tokens + unread - 1  # its last known or unread token's position
            if unread >= 0 and computed_before == last and request.num_output_tokens + unread > 0:
                decode += num_new
            else:
                prefill += num_new
        return time.perf_counter(), prefill, decode

    def end_step(
        self,
        begun: tuple[float, int, int],
        so: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        num_preemptions: int,
    ) -> None:
        start, prefill, decode = begun
        drafted = accepted = 0
        if so.scheduled_spec_decode_tokens:
            index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
            for req_id, drafts in so.scheduled_spec_decode_tokens.items():
                i = index.get(req_id)
                if i is None or not drafts:
                    continue
                # The target samples one token past the accepted drafts.
                num_accepted = max(len(runner_output.sampled_token_ids[i]) - 1, 0)
                counts = self._spec.setdefault(req_id, _SpecCounts())
                counts.drafted += len(drafts)
                counts.accepted += num_accepted
                drafted += len(drafts)
                accepted += num_accepted
            self._forget_finished()
        self.num_steps += 1
        # From its launch, or from the last step's read if that came later: with async
        # scheduling a step launches before the one ahead of it is read, and the durations
        # still add up to the engine's time instead of counting the overlap twice.
        now = time.perf_counter()
        duration = now - max(start, self._last_read)
        self._last_read = now
        self.steps.append(
            XrayStep(
                index=self.num_steps,
                timestamp=time.time(),
                duration_ms=duration * 1e3,
                num_reqs=len(so.num_scheduled_tokens),
                num_prefill_tokens=prefill,
                num_decode_tokens=decode,
                num_preemptions=num_preemptions,
                num_draft_tokens=drafted,
                num_accepted_tokens=accepted,
            )
        )

    def _forget_finished(self) -> None:
        if len(self._spec) > len(self.scheduler.requests):
            live = self.scheduler.requests
            for req_id in [r for r in self._spec if r not in live]:
                del self._spec[req_id]

    # ------------------------------------------------------------------ snapshots
    def watch(self, seconds: float) -> XraySnapshot:
        """A viewer is interested for `seconds` more: snapshots ride on the step outputs until
        then. Returns one of now (or of the last interval: many viewers cost one snapshot), so
        an idle engine is drawn too."""
        now = time.monotonic()
        self._watch_until = now + max(seconds, 0.0)
        if self._last is not None and now - self._last_snapshot < self.spacing:
            return self._last
        return self._take(now)

    def maybe_snapshot(self) -> XraySnapshot | None:
        """A snapshot if a viewer watches and the last one is `spacing` old, else None."""
        now = time.monotonic()
        if now >= self._watch_until or now - self._last_snapshot < self.spacing:
            return None
        return self._take(now)

    @property
    def spacing(self) -> float:
        """Seconds between snapshots: `interval`, or longer where building one takes more than
        MAX_TIME_SHARE of that time."""
        return max(self.interval, self._build_seconds / MAX_TIME_SHARE)

    def _take(self, now: float) -> XraySnapshot:
        start = time.perf_counter()
        self._last = self.snapshot()
        self._build_seconds = time.perf_counter() - start
        self._last_snapshot = now
        return self._last

    def snapshot(self) -> XraySnapshot:
        scheduler = self.scheduler
        pool = scheduler.kv.block_pool
        states = bytearray(pool.num_blocks)
        refs = bytearray(pool.num_blocks)
        for block in pool.blocks:
            refs[block.block_id] = min(block.ref_cnt, 255)
            states[block.block_id] = _block_state(block.is_null, block.ref_cnt, block.block_hash)
        free_order = []
        for block in pool.free_block_queue.iter_free_blocks():
            if len(free_order) == MAX_FREE_ORDER:
                break
            free_order.append(block.block_id)
        # Running first (batch order), then the waiting queue in its order.
        ordered = [*scheduler.running, *scheduler.waiting]
        return XraySnapshot(
            timestamp=time.time(),
            step_index=self.num_steps,
            block_size=scheduler.kv.block_size,
            num_blocks=pool.num_blocks,
            block_states=bytes(states),
            ref_counts=bytes(refs),
            num_free_blocks=pool.num_free_blocks,
            free_order=free_order,
            num_requests=len(scheduler.requests),
            requests=[self._request_row(r) for r in ordered[:MAX_REQUEST_ROWS]],
            steps=list(self.steps),
            kv_loading=[
                r.request_id
                for r in scheduler.waiting
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ],
            kv_sending=list(scheduler.delayed_free_request_ids),
        )

    def _request_row(self, request: Request) -> XrayRequest:
        spec = self._spec.get(request.request_id)
        block_ids = self.scheduler.kv.get_block_ids(request.request_id)
        return XrayRequest(
            request_id=request.request_id,
            status=_STATUS_NAMES.get(request.status, request.status.name.lower()),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions,
            block_ids=block_ids[:MAX_ROW_BLOCK_IDS],
            num_blocks=len(block_ids),
            priority=request.priority,
            num_draft_tokens=spec.drafted if spec else 0,
            num_accepted_tokens=spec.accepted if spec else 0,
        )


def _block_state(is_null: bool, ref_cnt: int, block_hash: bytes | None) -> int:
    if is_null:
        return BlockState.NULL
    if ref_cnt == 0:
        return BlockState.FREE if block_hash is None else BlockState.CACHED
    return BlockState.USED if ref_cnt == 1 else BlockState.SHARED
