"""EngineCore: the step loop — schedule → execute → update (L4).

It knows nothing of text: token ids in, token ids out. The same object runs in-process (tests,
offline) or inside its own process behind ZMQ.

With async scheduling, each step() schedules and launches the next step before reading the
last one's tokens, so the host's scheduling, input preparation and output handling run while
the device computes:

    step k:   schedule(n+1) → launch(n+1) → read(n) → update(n)    [device: n, then n+1]

A decode in step n+1 feeds the token step n sampled, taken on the device from that step's
sampled ids; the scheduler counts such tokens as placeholders. A request that stopped in step
n was scheduled in n+1 too: that token is dropped, and its blocks are freed at update(n) (steps
run in order on the device, so n+1's writes land before any later step reuses them).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from tokenbus.config import EngineConfig
from tokenbus.core.kv import KVCacheManager, make_block_hasher
from tokenbus.core.kv.hybrid import HybridKVCacheManager, engine_kv_groups
from tokenbus.core.outputs import PendingOutput
from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.core.sched.scheduler import Scheduler
from tokenbus.core.xray import XrayRecorder
from tokenbus.engine.executor import Executor, UniProcExecutor, WorkerBase, make_executor
from tokenbus.engine.lora_registry import LoRARegistry
from tokenbus.engine.setup import resolve_config
from tokenbus.kv_transfer.layout import kv_layout
from tokenbus.model_arch import ModelArch
from tokenbus.protocol import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    SchedulerStats,
    XraySnapshot,
)
from tokenbus.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from tokenbus.loader import ModelSource
    from tokenbus.structured.backend import XgrammarBackend


class _LaunchedStep(NamedTuple):
    scheduler_output: SchedulerOutput
    pending: PendingOutput
    xray_begun: tuple[float, int, int]


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        arch: ModelArch,
        eos_token_id: int | None,
        worker: WorkerBase | None = None,
        executor: Executor | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """`worker` (tests: a fake) runs under a UniProcExecutor; by default the executor
        for config.parallel is built. Every `auto` of `config` is resolved here, once, before
        any worker starts (setup.resolve_config): self.config holds the facts.
        `extra_eos_token_ids`: the model's other EOS ids (EngineSetup's), which a grammar lets
        end the output as EOS does."""
        self.config = config = resolve_config(config, source)
        if executor is None:
            executor = (
                UniProcExecutor(worker)
                if worker is not None
                else make_executor(config, source, arch, eos_token_id)
            )
        self.executor = executor
        try:
            stop_ids = ((eos_token_id,) if eos_token_id is not None else ()) + tuple(
                t for t in extra_eos_token_ids if t != eos_token_id
            )
            self._init_after_executor(config, source, arch, stop_ids)
        except BaseException:
            executor.shutdown()  # no rank process (or placement group) outlives a failed start
            raise

    def _init_after_executor(
        self, config: EngineConfig, source: ModelSource, arch: ModelArch, stop_ids: tuple[int, ...]
    ) -> None:
        # Every rank measures what it can hold; all get the smallest count, so a block id means
        # the same slots on every rank.
        self.num_kv_blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        block_size = config.cache.block_size
        groups = engine_kv_groups(config, arch)
        if groups is None:  # every layer full attention (or windows held whole): one table
            self.kv_cache_manager = KVCacheManager(
                self.num_kv_blocks, block_size, enable_caching=config.cache.enable_prefix_caching
            )
        else:
            self.kv_cache_manager = HybridKVCacheManager(
                self.num_kv_blocks, block_size, groups, config.cache.enable_prefix_caching
            )
        self._block_hasher = (
            make_block_hasher(block_size) if config.cache.enable_prefix_caching else None
        )
        self.grammar_manager = _make_grammar_manager(config, source, arch, stop_ids)
        self.kv_connector = _make_scheduler_connector(config, arch)
        if self.kv_connector is not None:
            block_size = config.cache.block_size
            self._block_hasher = make_block_hasher(block_size)  # connectors key blocks by hash
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            self.grammar_manager,
            num_lookahead_tokens=_num_lookahead_tokens(config),
            kv_connector=self.kv_connector,
            kv_load_failure_policy=(
                config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "recompute"
            ),
            max_loras=config.lora.max_loras if config.lora is not None else None,
        )
        self.loras = LoRARegistry(config.lora, arch)
        # req_id → wall-clock time of its first scheduling, until its first output carries it.
        self._first_scheduled_times: dict[str, float] = {}
        self.xray = XrayRecorder(self.scheduler)  # /xray: step records; snapshots when watched
        # Launched steps not read back yet, oldest first: at most two (async scheduling).
        self._in_flight: deque[_LaunchedStep] = deque()

    def add_request(self, request: EngineRequest) -> None:
        lora_id = self.loras.id_for(request.lora_request)  # a bad adapter fails this request
        self.scheduler.add_request(
            Request.from_engine_request(request, self._block_hasher, lora_id)
        )

    def check_lora(self, lora_name: str, lora_path: str) -> int:
        """Check an adapter against the model before requests name it (utility call): its
        number, or a ValueError saying why it cannot run."""
        return self.loras.check(lora_name, lora_path)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in request_ids:
            self._first_scheduled_times.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps launched and not read back yet (async scheduling: 0 to 2)."""
        return len(self._in_flight)

    def step(self) -> EngineOutputs:
        if self.config.scheduler.async_scheduling:
            return self._step_ahead()
        if not self.scheduler.has_unfinished_requests():
            return EngineOutputs(timestamp=time.monotonic())
        return self._finish(self._launch())

    def _step_ahead(self) -> EngineOutputs:
        """Launch the next step, then read the oldest one in flight (see the module doc).
        While a request is under a grammar, steps run one at a time."""
        ahead = self.scheduler.can_schedule_ahead
        if self.scheduler.has_unfinished_requests() and (ahead or not self._in_flight):
            self._in_flight.append(self._launch())
            if ahead and len(self._in_flight) == 1:
                # Nothing to read yet: the next call launches another step before this is read.
                return EngineOutputs(timestamp=time.monotonic())
        if not self._in_flight:
            return EngineOutputs(timestamp=time.monotonic())
        outputs = self._finish(self._in_flight.popleft())
        if self._in_flight and not self.scheduler.has_unfinished_requests():
            # Every request ended: the step launched after holds only void tokens. Read it
            # now rather than keep its buffers until the next request (its counters are 0).
            self._finish(self._in_flight.popleft())
        return outputs

    def _launch(self) -> _LaunchedStep:
        scheduler_output = self.scheduler.schedule()
        begun = self.xray.begin_step(scheduler_output)
        self._note_first_scheduled(scheduler_output)
        return _LaunchedStep(scheduler_output, self.executor.launch_model(scheduler_output), begun)

    def _finish(self, step: _LaunchedStep) -> EngineOutputs:
        scheduler_output = step.scheduler_output
        runner_output = step.pending.result()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._attach_first_scheduled(outputs)
        stats = self.scheduler.make_stats()
        self.xray.end_step(step.xray_begun, scheduler_output, runner_output, stats.num_preemptions)
        return EngineOutputs(
            outputs=outputs,
            scheduler_stats=stats,
            timestamp=time.monotonic(),
            xray=self.xray.maybe_snapshot(),
        )

    def _note_first_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        now = time.time()
        for new_req in scheduler_output.scheduled_new_reqs:
            # A request resumed after preemption with output tokens was reported already;
            # one preempted during its prefill keeps its first time (setdefault).
            if not new_req.output_token_ids:
                self._first_scheduled_times.setdefault(new_req.req_id, now)

    def _attach_first_scheduled(self, outputs: list[EngineOutput]) -> None:
        if not self._first_scheduled_times:  # steady decoding: nothing newly scheduled
            return
        for output in outputs:
            first = self._first_scheduled_times.pop(output.request_id, None)
            if first is not None:
                output.first_scheduled_time = first

    def make_gauge_stats(self) -> SchedulerStats:
        """Queue lengths and KV usage only, no per-step counters: sent when aborts change them
        between steps (an idle engine takes no step that would report them)."""
        return SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
        )

    def xray_watch(self, seconds: float) -> XraySnapshot:
        """/xray's viewer is interested for `seconds` more; a snapshot of now (utility call)."""
        return self.xray.watch(seconds)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        if getattr(self, "kv_connector", None) is not None and hasattr(
            self.kv_connector, "shutdown"
        ):
            self.kv_connector.shutdown()
        self.executor.shutdown()


def _make_scheduler_connector(config: EngineConfig, arch: ModelArch):
    if config.kv_transfer is None:
        return None
    from tokenbus.kv_transfer.factory import connector_context, make_scheduler_connector

    return make_scheduler_connector(
        connector_context(
            config.kv_transfer, kv_layout(config, arch), config.parallel.data_parallel_rank
        )
    )


def _num_lookahead_tokens(config: EngineConfig) -> int:
    """KV slots past the scheduled tokens: a draft model writes its k drafts' KV there right
    after the step (the n-gram proposer writes no KV)."""
    spec = config.speculative
    return spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0


def _make_grammar_manager(
    config: EngineConfig, source: ModelSource, arch: ModelArch, stop_ids: tuple[int, ...]
) -> StructuredOutputManager:
    """The tokenizer is loaded only when the first constrained request arrives. `stop_ids`:
    every EOS id of the model (Gemma's <eos> and <end_of_turn>), each one a grammar accepts at
    its end, as xgrammar's stop tokens."""

    def make_backend() -> XgrammarBackend:
        from tokenbus.loader import load_tokenizer

        # Imported here: xgrammar (seconds) stays off the engine's start-up.
        from tokenbus.structured.backend import XgrammarBackend

        tokenizer = load_tokenizer(source, config.model.tokenizer)
        stops = list(stop_ids) or None  # None: xgrammar's guess from the tokenizer
        return XgrammarBackend.from_tokenizer(tokenizer, arch.vocab_size, stop_token_ids=stops)

    return StructuredOutputManager(make_backend)
