"""AsyncLLM: the asyncio front end the OpenAI server uses (L4).

    generate(): input processor (checks) → n>1 fan-out, register → client.add_request_async
        → EngineCore (generate_request(): the same for a request the server has checked)
    output handler task: client.get_output_async ← EngineCore
        → RequestStatsTracker (TTFT, ITL) → OutputProcessor (text, stop strings)
        → per-request asyncio.Queue → generate() yields DELTA RequestOutputs
        → abort in the engine what stop strings ended; stat loggers record the batch

One output-handler task per event loop serves every request. Cancelling a generate()
(client disconnect) aborts its children in the engine, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from tokenbus.engine.client_factory import start_engine
from tokenbus.engine.core_client import EngineCoreClient
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.input_processor import InputProcessor
from tokenbus.engine.output_processor import OutputKind, OutputProcessor
from tokenbus.engine.outputs import CompletionOutput, RequestOutput
from tokenbus.engine.parallel_sampling import child_request_ids, register_children
from tokenbus.engine.setup import EngineSetup, create_engine_setup
from tokenbus.engine.stats import IterationStats, RequestStatsTracker, StatLogger
from tokenbus.engine.xray_hub import XrayHub
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import (
    EngineOutputs,
    EngineRequest,
    LoRARequest,
    SchedulerStats,
    XraySnapshot,
)
from tokenbus.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

XRAY_WATCH_SPACING_S = 1.0  # the engines are asked at most this often, however many viewers

# What a request's queue carries: outputs, or the error that ends the request.
_StreamItem = RequestOutput | BaseException


class AsyncLLM:
    def __init__(
        self,
        setup: EngineSetup,
        tokenizer,
        client: EngineCoreClient,
        stat_loggers: list[StatLogger] | None = None,
    ) -> None:
        self.setup = setup
        self.config = setup.config
        self.tokenizer = tokenizer
        self.client = client
        self.input_processor = InputProcessor(
            tokenizer, setup.config, setup.eos_token_id, setup.arch, setup.extra_eos_token_ids
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.stats_tracker = RequestStatsTracker()
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.last_scheduler_stats: SchedulerStats | None = None
        self.xray_hub = XrayHub()  # the newest /xray snapshot of each engine
        self._xray_watched_at = float("-inf")
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        self._output_task: asyncio.Task | None = None
        self._handler_error: EngineDeadError | None = None

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        in_process: bool = False,
        stat_loggers: list[StatLogger] | None = None,
    ) -> AsyncLLM:
        """Resolve the model, load the tokenizer and start the engine (blocks until it is
        ready; raises with the engine's message when it cannot start)."""
        setup = create_engine_setup(args)
        tokenizer, client = start_engine(
            setup,
            multiprocess=not in_process,
            asyncio_mode=True,
            ready_timeout_s=args.engine_ready_timeout_s,
        )
        return cls(setup, tokenizer, client, stat_loggers)

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """DELTA outputs, one child (`outputs[0].index`) each; `finished` on the last one.

        Raises ValueError for invalid input before the first output, EngineDeadError if the
        engine dies. Cancelling the iteration aborts the request in the engine.
        """
        request = self.input_processor.make_request(
            request_id,
            prompt_token_ids,
            params,
            cache_salt=cache_salt,
            priority=priority,
            lora_request=lora_request,
        )
        async with aclosing(self.generate_request(request, prompt)) as outputs:
            async for output in outputs:
                yield output

    async def generate_request(
        self, request: EngineRequest, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """generate() for a request the input processor has built, and so checked: the server
        builds its requests on a preparation thread, off the event loop."""
        request_id = request.request_id
        children, stream = self._register(request, prompt)
        try:
            for child in children:
                await self.client.add_request_async(child)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        except BaseException:
            # Cancelled (client disconnect), closed early or failed: free the engine's blocks.
            self._abort_children(request_id)
            raise
        finally:
            self._streams.pop(request_id, None)

    def _register(
        self, request: EngineRequest, prompt: str | None
    ) -> tuple[list[EngineRequest], asyncio.Queue[_StreamItem]]:
        """Register the request's children on this side (all or nothing)."""
        self._raise_if_dead()
        request_id = request.request_id
        child_ids = child_request_ids(request_id, request.sampling_params.n)
        # A parent id or a child id ("0_x" of "x" with n > 1) may already be running.
        if request_id in self._streams or any(
            c in self.output_processor.children for c in child_ids
        ):
            raise ValueError(f"request_id {request_id!r} is already in use by a running request")
        children = register_children(self.output_processor, request, prompt, OutputKind.DELTA)
        self._ensure_output_handler()
        stream: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._streams[request_id] = stream
        for child in children:
            self.stats_tracker.add_request(
                child.request_id, request.arrival_time, len(request.prompt_token_ids)
            )
        return children, stream

    async def abort(self, request_id: str) -> None:
        """Abort a running request; its generate() ends with finish_reason "abort"."""
        parent = self.output_processor.parents.get(request_id)
        indexes = self._abort_children(request_id)
        stream = self._streams.get(request_id)
        if parent is None or stream is None:
            return
        for i, index in enumerate(indexes):
            completion = CompletionOutput(index=index, text="", token_ids=[], finish_reason="abort")
            stream.put_nowait(
                RequestOutput(
                    request_id=request_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=[completion],
                    finished=i == len(indexes) - 1,
                    metrics=parent.metrics,
                    num_cached_tokens=parent.num_cached_tokens,
                )
            )

    def _abort_children(self, request_id: str) -> list[int]:
        """Abort the unfinished children of a request here and in the engine; their indexes."""
        children = [
            (cid, child.index)
            for cid, child in self.output_processor.children.items()
            if child.parent.request_id == request_id
        ]
        child_ids = [cid for cid, _ in children]
        if not child_ids:
            return []
        self.output_processor.abort_requests(child_ids)
        self.stats_tracker.abort(child_ids, time.time())
        if self.dead_error is None:
            try:
                self.client.abort_requests(child_ids)  # never blocks: safe inside cancellation
            except EngineDeadError:
                pass  # nothing left to free
        return [index for _, index in children]

    @property
    def num_unfinished_requests(self) -> int:
        """Requests (parents) not finished yet, as the front end sees them."""
        return len(self.output_processor.parents)

    # ------------------------------------------------------------------ the output handler
    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._output_task
        if task is None or task.done() or task.get_loop() is not loop:
            self._output_task = loop.create_task(
                self._run_output_handler(), name="AsyncLLM.output_handler"
            )

    async def _run_output_handler(self) -> None:
        try:
            while True:
                self._process_engine_outputs(await self.client.get_output_async())
        except EngineDeadError as exc:
            self._fail_all(exc)
        except Exception as exc:  # a bug on this side: fail loudly rather than hang requests
            logger.exception("AsyncLLM output handler failed")
            error = EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}")
            self._handler_error = error
            self._fail_all(error)

    def _process_engine_outputs(self, engine_outputs: EngineOutputs) -> None:
        # Order: stats see each output before the output processor may finish its request.
        now = time.time()
        outputs = engine_outputs.outputs
        iteration_stats = self.stats_tracker.update(outputs, now)
        processed = self.output_processor.process_outputs(outputs, now)
        for request_output in processed.request_outputs:
            stream = self._streams.get(request_output.request_id)
            if stream is not None:  # None: its generate() was cancelled meanwhile
                stream.put_nowait(request_output)
        self._record_finished(engine_outputs, now, iteration_stats)
        if processed.reqs_to_abort:
            # Stopped by a stop string: only this side can see text, the engine must be told.
            self.client.abort_requests(processed.reqs_to_abort)
        if engine_outputs.scheduler_stats is not None:
            self.last_scheduler_stats = engine_outputs.scheduler_stats
        if engine_outputs.xray is not None:
            self.xray_hub.publish(engine_outputs.engine_index, engine_outputs.xray)
        self._log_stats(
            engine_outputs.scheduler_stats, iteration_stats, engine_outputs.engine_index
        )

    def _record_finished(
        self, engine_outputs: EngineOutputs, now: float, stats: IterationStats
    ) -> None:
        for output in engine_outputs.outputs:
            if output.request_id not in self.output_processor.children:
                # Finished by the engine, or by a stop string (the engine did not finish it).
                reason = str(output.finish_reason) if output.finish_reason is not None else "stop"
                self.stats_tracker.finish(output.request_id, reason, now, stats)

    def _log_stats(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
        engine_index: int,
    ) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats, engine_index)
            except Exception:  # metrics must never take serving down
                logger.exception("stat logger %r failed", stat_logger)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    # ------------------------------------------------------------------ health and utilities
    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.client.dead_error or self._handler_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def _raise_if_dead(self) -> None:
        if (error := self.dead_error) is not None:
            raise error

    async def check_health(self) -> None:
        self._raise_if_dead()

    def seconds_without_progress(self) -> float | None:
        """The longest an engine with unfinished requests has gone without a word (step
        outputs, or the heartbeat its loop sends while it turns); None while none has work.
        A step that runs long counts too: the loop only speaks between steps."""
        silent = self.client.seconds_silent()
        in_flight = self.client.in_flight_per_engine() or [self.num_unfinished_requests]
        busy = [seconds for seconds, num in zip(silent, in_flight) if num > 0]
        return max(busy) if busy else None

    def dump_engine_stacks(self) -> None:
        self.client.dump_engine_stacks()

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility("reset_prefix_cache")

    async def xray_watch(self, seconds: float) -> None:
        """Keep every engine snapshotting for /xray for `seconds` more; their snapshots of now
        go to the hub at once (an idle engine sends no step outputs to carry them)."""
        now = time.monotonic()
        if now - self._xray_watched_at < XRAY_WATCH_SPACING_S:  # many viewers: one renewal
            return
        self._xray_watched_at = now
        results = await self.client.call_utility_each_async("xray_watch", seconds)
        for index, snapshot in enumerate(results):
            if not isinstance(snapshot, XraySnapshot):  # across a process: plain containers
                snapshot = msgspec.convert(snapshot, XraySnapshot)
            self.xray_hub.publish(index, snapshot)

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._raise_if_dead()
        return await self.client.call_utility_async(method, *args)

    def shutdown(self) -> None:
        """Stop the engine. The client then reports EngineDeadError to the output handler,
        which ends every in-flight generate() with it (in the loop's own thread)."""
        self.client.shutdown()
        self.input_processor.structured_validator.close()
