"""The phase-less scheduler (L1, no torch).

One rule, as in vLLM V1: each step, every scheduled request gets `num_new_tokens` so that its
`num_computed_tokens` catches up with `num_tokens_with_spec`, under one token budget. Prefill,
chunked prefill, decode, resume after preemption and speculative verification are all that rule.

A token scheduled to be sampled is a placeholder (Request.num_output_placeholders) until its
step's output comes back. With async scheduling the engine schedules the next step before
reading the last one's tokens: a decode then feeds its unread token (the worker takes it from
the last step's sampled ids on the device), and a request whose placeholders already reach
its max_tokens waits for them. A request under a grammar needs its tokens before its next
bitmask: from the schedule() that finds its grammar compiled until it ends, steps are scheduled
one at a time (while its grammar compiles it holds nobody back).

Step order: running requests first (in admission order; under the priority policy in
(priority, arrival) order, so the last is the one preempted: core/sched/queue_order), then
waiting ones (strict head of line, in the same order), then `num_computed_tokens` advances
optimistically;
`update_from_output` appends the sampled tokens, rolls back rejected drafts and checks stop
conditions.

With a KV connector, a waiting request may get tokens from outside the pool, synchronously
(in the step) or asynchronously (it waits in WAITING_FOR_REMOTE_KVS, keeping its place, holding
nobody up); a finished request's blocks may be freed only once the connector is done with them.
core/sched/external_kv.ExternalKV keeps that bookkeeping; the scheduler keeps the queues. Blocks
that failed to load are evicted from the prefix cache and their requests recompute (preempted)
or fail, per kv_load_failure_policy.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenbus.config import SchedulerConfig
from tokenbus.core.kv import KVCacheManager
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.sched.external_kv import ExternalKV
from tokenbus.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenbus.core.sched.ports import GrammarManager, KVConnectorScheduler
from tokenbus.core.sched.queue_order import QueueOrder
from tokenbus.core.sched.spec_metrics import SpecDecodeMetrics
from tokenbus.core.sched.stop import check_stop, max_output_tokens
from tokenbus.protocol import EngineOutput, SchedulerStats


class _Admission(enum.Enum):
    ADMITTED = 0
    NO_ROOM = 1  # strict head of line: nobody behind it is admitted this step
    WAITS = 2  # it keeps its place but holds nobody up (an asynchronous KV load)


@dataclass
class _StepPlan:
    """What one schedule() call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grammar_manager: GrammarManager | None = None,
        num_lookahead_tokens: int = 0,
        kv_connector: KVConnectorScheduler | None = None,
        kv_load_failure_policy: str = "recompute",
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        # Distinct LoRA adapters the running requests may use at once (None: no limit).
        self.max_loras = max_loras
        self.kv = kv_cache_manager
        self.grammar = grammar_manager
        # Slots reserved past the scheduled tokens for next step's drafts (spec decode).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.order = QueueOrder(config.scheduling_policy)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(): the worker must drop their state.
        self._finished_req_ids: set[str] = set()
        self._num_preemptions_step = 0
        self.num_preemptions_total = 0
        self._num_prompt_tokens_step = 0
        self._spec_counts = SpecDecodeMetrics()
        # Outputs for requests finished outside a model step (a grammar that failed to compile).
        self._pending_outputs: list[EngineOutput] = []
        self.external_kv = ExternalKV(kv_cache_manager, kv_connector)
        self.kv_load_failure_policy = kv_load_failure_policy
        # Preempted outside schedule() (a failed KV load): reported with the next step.
        self._preempted_outside_step: set[str] = set()
        # schedule() calls so far: the next step's SchedulerOutput.step_index.
        self._num_steps_scheduled = 0
        # Requests whose compiled grammar is in force, until they end (can_schedule_ahead).
        self._grammars_in_force: set[str] = set()

    @property
    def connector(self) -> KVConnectorScheduler | None:
        return self.external_kv.connector

    @connector.setter
    def connector(self, connector: KVConnectorScheduler | None) -> None:
        self.external_kv.connector = connector

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        req_id = request.request_id
        if req_id in self.requests or self.external_kv.is_delayed_free(req_id):
            raise ValueError(f"request_id {req_id!r} is already in the engine")
        if self.grammar is not None and request.sampling_params.structured_outputs is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar.add_request(request)
        self.requests[request.request_id] = request
        request.first_step_index = self._num_steps_scheduled
        self.order.arrive(self.waiting, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, stop string found by the front end)."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            self._remove_from_queue(request)
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            request.status = status
            # A load in flight still writes into the request's blocks: keep them until it ends.
            self._free_request(request, keep_blocks=loading)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or blocks a connector still moves (the worker must be polled)."""
        return bool(self.requests) or self.external_kv.has_delayed_free()

    @property
    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the last one's tokens are read: no
        request's grammar is in force, whose bitmask for the next step is built here from the
        tokens it accepted. A request whose grammar still compiles is in no step: it holds
        nobody back. Its first step may be scheduled ahead, since that bitmask is the grammar's
        start; the steps after it wait for its tokens."""
        return not self._grammars_in_force

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def delayed_free_request_ids(self) -> list[str]:
        """Finished requests whose blocks a connector still reads or writes."""
        return self.external_kv.delayed_free_request_ids

    def _remove_from_queue(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # A step that preempted admits nobody: the pool is under pressure.
        if not plan.preempted:
            self._schedule_waiting(plan)
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=plan.spec_tokens,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted} | self._preempted_outside_step,
            step_index=self._num_steps_scheduled,
        )
        self._num_steps_scheduled += 1
        if self.grammar is not None:
            self.grammar.fill_bitmask(output, self.requests)
        self.external_kv.attach_connector_meta(output)
        self._finished_req_ids = set()
        self._preempted_outside_step = set()
        self._advance_computed_tokens(plan)
        return output

    def _num_new_tokens(
        self, request: Request, num_computed: int, budget: int, num_tokens: int
    ) -> int:
        num_new = num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        # The chunk cap applies only when others compete for the budget.
        if 0 < threshold < num_new and len(self.running) + len(self.waiting) > 1:
            num_new = threshold
        # Never compute past max_model_len - 1 positions (the last token is sampled, not fed).
        return max(0, min(num_new, budget, self.config.max_model_len - 1 - num_computed))

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(
                request,
                request.num_computed_tokens,
                plan.token_budget,
                request.num_tokens_with_spec + request.num_output_placeholders,
            )
            if request.num_output_placeholders and request.num_output_tokens + (
                request.num_output_placeholders
            ) >= max_output_tokens(request, self.config.max_model_len):
                num_new = 0  # its unread tokens reach max_tokens: it ends with them
            if num_new == 0:
                i += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if new_blocks is None:  # the request preempted itself
                break
            first, *others = self.kv.block_ids_per_group(new_blocks)
            plan.cached_reqs.append(
                CachedRequestData(request.request_id, first, request.num_computed_tokens, others)
            )
            self._record(request, num_new, plan)
            i += 1

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan):
        """Allocate slots, preempting the last admitted request until it fits.

        Returns the new blocks, or None if `request` itself had to be preempted.
        """
        while True:
            new_blocks = self.kv.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_blocks is not None:
                return new_blocks
            # The last of `running`: the most recently admitted (fcfs), or the lowest priority,
            # latest arrival among equals (priority keeps `running` in that order).
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self._requeue_from_scratch(request)
        request.num_preemptions += 1
        plan.preempted.append(request)
        self._num_preemptions_step += 1
        self.num_preemptions_total += 1

    def _requeue_from_scratch(self, request: Request) -> None:
        """Free its blocks and put it first in line to recompute (its cached blocks are prefix
        hits again)."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # an unread token still appends when it comes back
        request.spec_token_ids = []
        self.order.requeue(self.waiting, request)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        skipped: list[Request] = []
        loras = {r.lora_id for r in self.running if r.lora_id}
        while (
            self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                if not self.grammar.is_ready(request):
                    skipped.append(self.waiting.popleft())  # keeps its place, blocks nobody
                    continue
                if request.is_finished:  # the grammar failed to compile
                    self.waiting.popleft()
                    self._free_request(request)
                    self._pending_outputs.append(
                        EngineOutput(
                            request_id=request.request_id,
                            new_token_ids=[],
                            finish_reason=request.status.finish_reason,
                        )
                    )
                    continue
                request.status = RequestStatus.WAITING
                self._grammars_in_force.add(request.request_id)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())  # its load is in flight
                continue
            if self._lora_slots_full(request, loras):
                skipped.append(self.waiting.popleft())  # waits for its adapter's turn
                continue
            admission = self._admit(request, plan)
            if admission is _Admission.NO_ROOM:
                break  # strict head of line: nobody overtakes a request that does not fit
            if admission is _Admission.WAITS:
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            if request.lora_id:
                loras.add(request.lora_id)
        self.waiting.extendleft(reversed(skipped))

    def _lora_slots_full(self, request: Request, loras: set[int]) -> bool:
        """Whether admitting `request` would run more distinct adapters than max_loras."""
        return (
            self.max_loras is not None
            and request.lora_id != 0
            and request.lora_id not in loras
            and len(loras) >= self.max_loras
        )

    def _admit(self, request: Request, plan: _StepPlan) -> _Admission:
        resumed_from_load = self.kv.holds_blocks(request.request_id)
        if resumed_from_load:
            # Its KV came in through an asynchronous connector load: it keeps its table.
            computed_blocks, num_computed, num_external, load_async = (
                [],
                request.num_computed_tokens,
                0,
                False,
            )
        else:
            computed_blocks, num_computed = self.kv.get_computed_blocks(request)
            num_external, load_async = self.external_kv.matched_tokens(request, num_computed)
            if num_external is None:
                return _Admission.WAITS  # the connector cannot tell yet
        if load_async and num_external > 0:
            if self.external_kv.start_load(request, num_computed, computed_blocks, num_external):
                return _Admission.WAITS  # in WAITING_FOR_REMOTE_KVS until its load ends
            return _Admission.NO_ROOM
        num_new = self._num_new_tokens(
            request, num_computed + num_external, plan.token_budget, request.num_tokens
        )
        if num_new == 0:
            return _Admission.NO_ROOM
        # External tokens take slots like new ones (the worker loads them before the forward).
        # (A request resumed from a load holds its computed tokens already: no new hit tokens.)
        new_blocks = self.kv.allocate_slots(
            request,
            num_external + num_new,
            num_computed - request.num_computed_tokens,
            computed_blocks,
            num_lookahead_tokens=self.num_lookahead_tokens,
        )
        if new_blocks is None:
            return _Admission.NO_ROOM
        request.num_computed_tokens = num_computed  # the local hit: external tokens follow it
        if not resumed_from_load:
            self.external_kv.admitted(request, num_computed, num_external)
        num_computed += num_external
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
        self.order.admit(self.running, request)
        first, *others = self.kv.get_all_block_ids(request.request_id)
        plan.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=first,
                num_computed_tokens=num_computed,
                lora_id=request.lora_id,
                lora_path=request.lora_request.lora_path if request.lora_request else None,
                group_block_ids=others,
            )
        )
        self._record(request, num_new, plan)
        return _Admission.ADMITTED

    def _record(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        plan.num_scheduled_tokens[request.request_id] = num_new
        plan.token_budget -= num_new
        # Drafts that fall inside this step's tokens are verified; any past the budget are dropped.
        num_spec = request.num_computed_tokens + num_new - request.num_tokens
        if num_spec > 0:
            plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []

    def _advance_computed_tokens(self, plan: _StepPlan) -> None:
        # Optimistic: the next schedule() may already issue the next chunk. Rejected drafts
        # are subtracted in update_from_output.
        for req_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            self._num_prompt_tokens_step += max(
                0, min(request.num_prompt_tokens - request.num_computed_tokens, num_new)
            )
            request.num_computed_tokens += num_new
            # A chunk reaching the end of its known and unread tokens samples one more.
            if (
                request.sampling_params.pooling is None
                and request.num_computed_tokens
                >= request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        kv_output = runner_output.kv_connector_output
        self.external_kv.receive_report(kv_output)
        failed_loads: set[str] = set()
        if kv_output is not None:
            failed_loads = self._handle_invalid_blocks(
                set(kv_output.invalid_block_ids), set(kv_output.finished_recving), outputs
            )
            self.external_kv.finish_transfers(kv_output, failed_loads, self.requests)
        # Before any of the step's requests finishes: a finished request's unsettled hit would
        # be dropped as never loaded.
        self.external_kv.settle_hits(scheduler_output.num_scheduled_tokens, failed_loads)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if (
                request is None
                or request.is_finished
                or req_id in failed_loads
                or request.first_step_index > scheduler_output.step_index
            ):
                # Aborted while the step ran, its KV load failed (recomputed), or a new request
                # took the id of one that ended while this step ran (async scheduling).
                continue
            index = runner_output.req_id_to_index[req_id]
            sampled = runner_output.sampled_token_ids[index]
            if sampled and request.num_output_placeholders:  # none after a preemption
                request.num_output_placeholders -= 1
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:
                # Accepted drafts + 1 sampled token came back; the rest of the drafts' KV is void.
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                self._spec_counts.record(len(drafts), len(sampled) - 1)
            if runner_output.pooled is not None and runner_output.pooled[index] is not None:
                outputs.append(self._finish_pooled(request, runner_output.pooled[index]))
                continue
            output = self._append_tokens(request, sampled, runner_output, index)
            if output is not None:
                outputs.append(output)
        return outputs

    def _append_tokens(
        self, request: Request, sampled: list[int], runner_output: ModelRunnerOutput, index: int
    ) -> EngineOutput | None:
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if check_stop(request, self.config.max_model_len):
                break
        if self.grammar is not None and new_token_ids:
            self.grammar.accept_tokens(request, new_token_ids)
        if request.is_finished:
            # Running, or preempted after its step was launched (async scheduling).
            self._remove_from_queue(request)
            self._free_request(request)
        elif runner_output.spec_token_ids is not None:
            request.spec_token_ids = self._valid_drafts(
                request, runner_output.spec_token_ids[index]
            )
        prompt_logprobs, prompt_logprobs_start = None, 0
        if runner_output.prompt_logprobs is not None:
            prompt_logprobs = runner_output.prompt_logprobs[index] or None
            prompt_logprobs_start = runner_output.prompt_logprobs_start[index]
        if not new_token_ids and not request.is_finished and prompt_logprobs is None:
            return None  # a partial prefill chunk: nothing to report
        logprobs = None
        if runner_output.logprobs is not None and runner_output.logprobs[index] is not None:
            logprobs = runner_output.logprobs[index][: len(new_token_ids)]
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            prompt_logprobs_start=prompt_logprobs_start,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            kv_transfer_params=request.kv_transfer_params_out,
        )

    def _finish_pooled(self, request: Request, pooled: list[float]) -> EngineOutput:
        """An embedding request is done once its whole prompt went through the model."""
        request.status = RequestStatus.FINISHED_STOPPED
        self._remove_from_queue(request)  # preempted after its last chunk launched: waiting
        self._free_request(request)
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=[],
            pooled=pooled,
            finish_reason=request.status.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def _valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Structured output: only the drafts the grammar accepts are worth verifying."""
        if (
            drafts
            and self.grammar is not None
            and request.sampling_params.structured_outputs is not None
        ):
            return self.grammar.validate_tokens(request, drafts)
        return drafts

    # ------------------------------------------------------------------ failed KV loads
    def _handle_invalid_blocks(
        self, invalid: set[int], recving: set[str], outputs: list[EngineOutput]
    ) -> set[str]:
        """Blocks whose load failed: every request holding one recomputes from scratch
        (preempted: its valid blocks are prefix hits again) or fails; returns those requests
        (their sampled tokens are void). ExternalKV evicts and truncates; the queues are ours."""
        if not invalid:
            return set()
        failed = set()
        recompute = self.kv_load_failure_policy == "recompute"
        for request in self.external_kv.holders_of_bad_blocks(invalid, self.requests.values()):
            self.external_kv.quarantine(request, invalid)
            if recompute and self.external_kv.truncate_load(request, invalid):
                continue  # its load keeps the blocks before the bad one; the rest is computed
            failed.add(request.request_id)
            loading = self.external_kv.abandon_load(request.request_id, recving)
            self._remove_from_queue(request)
            if self.kv_load_failure_policy == "fail":
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request, keep_blocks=loading)
                outputs.append(
                    EngineOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.status.finish_reason,
                    )
                )
                continue
            self._requeue_from_scratch(request)
            # What it reports as cached is what its next admission really finds (the external
            # tokens it was counted for are computed now; the step's hit counter keeps them).
            request.num_cached_tokens = None
            self._preempted_outside_step.add(request.request_id)
        return failed

    def _free_request(self, request: Request, keep_blocks: bool = False) -> None:
        self._grammars_in_force.discard(request.request_id)
        self.external_kv.release(request, keep_blocks)
        if self.grammar is not None:
            self.grammar.remove_request(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ stats and checks
    def make_stats(self) -> SchedulerStats:
        """The gauges, and the counters since the last call (which it resets): each schedule
        and each update is counted once, however the engine interleaves them."""
        prefix = self.kv.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions_step,
            num_prompt_tokens=self._num_prompt_tokens_step,
            spec_num_drafts=self._spec_counts.num_drafts,
            spec_num_draft_tokens=self._spec_counts.num_draft_tokens,
            spec_num_accepted_tokens=self._spec_counts.num_accepted_tokens,
            spec_accepted_per_pos=self._spec_counts.accepted_per_pos,
            **self.external_kv.transfer_stats(),
        )
        self._num_preemptions_step = self._num_prompt_tokens_step = 0
        self._spec_counts = SpecDecodeMetrics()
        return stats

    def check_integrity(self) -> None:
        """After all requests finished: no request in any queue, every block free."""
        assert not self.requests, f"requests left: {list(self.requests)}"
        self.external_kv.check_integrity()
        assert not self.waiting and not self.running, "queues not empty"
        self.kv.check_integrity()
