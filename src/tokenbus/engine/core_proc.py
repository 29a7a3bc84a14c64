"""The EngineCore in its own process: I/O threads around a busy loop (L4).

    input thread:  DEALER socket → decode → input_queue
    main thread:   drain input_queue (ADD, ABORT, UTILITY, SHUTDOWN) → step() while there is
                   work → output_queue; block on input_queue when idle; a HEARTBEAT after
                   HEARTBEAT_S without any other message
    output thread: output_queue → encode → PUSH socket

ZMQ releases the GIL, so (de)serialization overlaps with the model's forward pass. The same
busy loop (`EngineCoreLoop`) also runs in a thread of the front end's process when the engine
is in-process but the front end is asyncio (`AsyncInprocClient`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import zmq

from tokenbus.engine.messages import (
    Codec,
    Empty,
    EngineFailure,
    MessageType,
    ReadyInfo,
    RequestType,
    UtilityCall,
    UtilityResult,
)
from tokenbus.protocol import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    SchedulerStats,
)
from tokenbus.utils.log import log_safe
from tokenbus.utils.parent_watch import start_parent_watch

if TYPE_CHECKING:
    # Not at run time: the front end imports this module to spawn the engine, and EngineCore's
    # imports (torch, xgrammar) belong to the engine process, off the server's start-up path.
    from tokenbus.engine.core import EngineCore
    from tokenbus.engine.setup import EngineSetup

logger = logging.getLogger(__name__)

# Builds the EngineCore in the engine process. Must be a module-level function (it crosses to
# the spawned process by reference); tests pass one that builds a core with a fake worker.
EngineFactory = Callable[["EngineSetup"], "EngineCore"]
STACK_DUMP_SIGNAL = signal.SIGUSR1
# Called by the busy loop with each message for the front end.
Emit = Callable[[MessageType, Any], None]

IO_POLL_MS = 100  # how often the input thread looks up from its socket to check for shutdown
CLOSE_LINGER_MS = 2000  # time the last messages (ENGINE_DEAD) get to leave on exit
IDLE_BACKOFF_S = 0.001  # wait when requests exist but none can run
HEARTBEAT_S = 1.0  # the longest the loop stays silent while it turns (see MessageType.HEARTBEAT)
# Leaving (close() + logging) takes well under this; past it the exit is stuck: dump every
# thread's stack to stderr and exit anyway. Below the front end's SHUTDOWN_TIMEOUT_S.
EXIT_DEADLINE_S = 4.0


def make_engine_core(setup: EngineSetup) -> EngineCore:
    """The default factory: the real EngineCore (loads the model)."""
    from tokenbus.engine.core import EngineCore

    return EngineCore(
        setup.config,
        setup.source,
        setup.arch,
        setup.eos_token_id,
        extra_eos_token_ids=setup.extra_eos_token_ids,
    )


@dataclass(frozen=True)
class EngineAddresses:
    """ZMQ endpoints bound by the front end; the engine connects to both."""

    input_address: str  # front end ROUTER → engine DEALER
    output_address: str  # engine PUSH → front end PULL

    @property
    def ipc_dir(self) -> str | None:
        """The private directory holding both ipc:// socket files, if that is the transport."""
        if not self.input_address.startswith("ipc://"):
            return None
        return os.path.dirname(self.input_address.removeprefix("ipc://"))


def call_utility(engine: EngineCore, call: UtilityCall) -> UtilityResult:
    """Run a public EngineCore method; errors travel back as text, never as objects."""
    try:
        if call.method.startswith("_") or not callable(getattr(engine, call.method, None)):
            raise ValueError(f"utility {call.method!r} is not a public EngineCore method")
        return UtilityResult(call.call_id, result=getattr(engine, call.method)(*call.args))
    except Exception as exc:  # the engine stays up: a bad utility call is the caller's problem
        return UtilityResult(call.call_id, error_type=type(exc).__name__, error=str(exc))


def raise_in_loop_on_worker_death(
    engine: EngineCore, input_queue: queue.Queue[tuple[RequestType, Any]]
) -> None:
    """A dead worker wakes the busy loop (which may be idle, blocked on its queue) so that it
    raises at once: the engine then reports itself dead and every waiter fails."""
    engine.executor.register_failure_callback(
        lambda: input_queue.put((RequestType.EXECUTOR_FAILED, None))
    )


class EngineCoreLoop:
    """The busy loop: inputs first (so aborts land before the next step), then one step."""

    def __init__(
        self, engine: EngineCore, input_queue: queue.Queue[tuple[RequestType, Any]], emit: Emit
    ) -> None:
        self.engine = engine
        self.input_queue = input_queue
        self._send = emit
        self._last_emit = time.monotonic()
        self._shutdown = False
        # Aborts changed the queues: an idle engine must still report its gauges once.
        self._gauges_stale = False
        # The gauges the front end last heard (it starts from an empty engine's): a step that
        # ran nothing but changed them (a prefiller freeing blocks nobody pulled, a request
        # starting to wait) is reported, or they would stay stale until the next real work.
        self._reported_gauges: tuple[int, int, float] = (0, 0, 0.0)

    def run(self) -> None:
        """Return on SHUTDOWN; any exception escapes to the caller (the engine is then dead)."""
        while not self._shutdown:
            self._process_input_queue()
            if not self._shutdown:
                self._process_engine_step()
            if time.monotonic() - self._last_emit >= HEARTBEAT_S:
                self.emit(MessageType.HEARTBEAT, Empty())

    def emit(self, kind: MessageType, payload: Any) -> None:
        self._last_emit = time.monotonic()
        if isinstance(payload, EngineOutputs) and payload.scheduler_stats is not None:
            self._reported_gauges = _gauges(payload.scheduler_stats)
        self._send(kind, payload)

    def _process_input_queue(self) -> None:
        # Block only when idle: with requests in flight the loop must keep stepping. Even idle,
        # wake up for the heartbeat.
        if not self.engine.has_unfinished_requests() and not self._gauges_stale:
            try:
                self._handle(*self.input_queue.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                return
        while not self._shutdown:
            try:
                self._handle(*self.input_queue.get_nowait())
            except queue.Empty:
                break

    def _handle(self, kind: RequestType, payload: Any) -> None:
        if kind is RequestType.ADD:
            self._add_request(payload)
        elif kind is RequestType.ABORT:
            self.engine.abort_requests(payload)
            self._gauges_stale = True
        elif kind is RequestType.UTILITY:
            self.emit(MessageType.UTILITY_RESULT, call_utility(self.engine, payload))
        elif kind is RequestType.SHUTDOWN:
            self._shutdown = True
        elif kind is RequestType.EXECUTOR_FAILED:
            self.engine.executor.check_health()  # raises the executor's own message
            raise RuntimeError("the executor reported a failed worker")

    def _add_request(self, request: EngineRequest) -> None:
        # The front end validates requests; one that still fails here (a duplicate id) must
        # fail alone, not take the engine and every other request down.
        try:
            self.engine.add_request(request)
        except Exception as exc:
            logger.error(
                "rejected request %s: %s", log_safe(request.request_id, 100), log_safe(exc)
            )
            failed = EngineOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            self.emit(
                MessageType.OUTPUTS, EngineOutputs(outputs=[failed], timestamp=time.monotonic())
            )

    def _process_engine_step(self) -> None:
        if self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            if outputs.scheduler_stats is None and self.engine.num_steps_in_flight:
                return  # it launched a step and read none (async scheduling): nothing to say
            if not self.engine.has_unfinished_requests():
                # The last work just ended (e.g. a KV connector's delayed free): the gauges an
                # idle engine shows must be this step's, not the last reported one's.
                self._gauges_stale = True
            if _did_work(outputs) or self._gauges_stale or self._gauges_changed(outputs):
                self.emit(MessageType.OUTPUTS, outputs)
                self._gauges_stale = False
            else:
                self._back_off()
        elif self._gauges_stale:
            stats = self.engine.make_gauge_stats()
            self.emit(
                MessageType.OUTPUTS,
                EngineOutputs(scheduler_stats=stats, timestamp=time.monotonic()),
            )
            self._gauges_stale = False

    def _gauges_changed(self, outputs: EngineOutputs) -> bool:
        stats = outputs.scheduler_stats
        return stats is not None and _gauges(stats) != self._reported_gauges

    def _back_off(self) -> None:
        # Nothing could run (every request waits, e.g. for its grammar to compile): wait a
        # little for new input instead of spinning and flooding the front end with reports.
        try:
            self._handle(*self.input_queue.get(timeout=IDLE_BACKOFF_S))
        except queue.Empty:
            pass


def _shutdown_executor(engine: EngineCore) -> None:
    try:
        engine.shutdown()
    except Exception:  # leaving anyway: the workers' own sentinels and watchdogs end them
        logger.exception("executor shutdown failed")


def _gauges(stats: SchedulerStats) -> tuple[int, int, float]:
    return stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage


def _did_work(outputs: EngineOutputs) -> bool:
    """A step that ran nothing produces no outputs, leaves nobody running and moved no KV (a
    prefiller serves pulls, and a decoder starts its loads, in steps that run nothing: their
    counters must still reach the front end); an /xray snapshot is sent whatever the step
    did (an engine whose requests all wait for KV loads is drawn too)."""
    stats = outputs.scheduler_stats
    return (
        bool(outputs.outputs)
        or outputs.xray is not None
        or stats is None
        or bool(
            stats.num_running_reqs
            or stats.num_preemptions
            or stats.kv_bytes_saved
            or stats.kv_bytes_loaded
            or stats.external_prefix_cache_queries
            or stats.external_prefix_cache_hits  # a load that ended: its hit counts now
        )
    )


# ---------------------------------------------------------------------- the engine process
def run_engine_core(
    setup: EngineSetup,
    addresses: EngineAddresses,
    parent_pid: int,
    engine_factory: EngineFactory = make_engine_core,
    log_level: int = logging.INFO,
) -> None:
    """Entry point of the spawned EngineCore process."""
    logging.basicConfig(
        level=log_level, format="(EngineCore pid=%(process)d) %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C reaches the whole process group: the front end decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The front end's stall watchdog asks for every thread's stack this way; faulthandler's
    # handler is C, so it answers even while a step hangs inside native code.
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    start_parent_watch(parent_pid, "EngineCoreParentWatch", partial(_remove_ipc_dir, addresses))
    proc = EngineCoreProc(addresses)
    try:
        engine = proc.start_engine(setup, engine_factory)
        if engine is not None:
            proc.serve(engine)
    finally:
        faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)
        proc.close()
    # Everything is sent and the front end knows why we stop: skip the interpreter's teardown
    # (a second or more of torch finalizers) so that shutdown is quick.
    logging.shutdown()
    os._exit(1 if proc.failed else 0)


def _remove_ipc_dir(addresses: EngineAddresses) -> None:
    # An orphaned engine removes the socket files that its dead front end no longer can.
    if (ipc_dir := addresses.ipc_dir) is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)


class EngineCoreProc:
    """Sockets and threads of the engine process around an EngineCoreLoop."""

    def __init__(self, addresses: EngineAddresses) -> None:
        self.failed = False
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.DEALER)
        self.input_socket.connect(addresses.input_address)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(addresses.output_address)
        self.input_queue: queue.Queue[tuple[RequestType, Any]] = queue.Queue()
        # (kind, payload) for the front end; payloads are fresh objects the loop never touches
        # again, so the output thread may encode them while the next step runs.
        self.output_queue: queue.Queue[tuple[MessageType, Any] | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start_engine(self, setup: EngineSetup, engine_factory: EngineFactory) -> EngineCore | None:
        """Build the engine and answer the handshake on the input socket (READY or
        STARTUP_FAILED); the first message also registers our route with the ROUTER."""
        codec = Codec()
        try:
            engine = engine_factory(setup)
        except BaseException as exc:
            logger.exception("EngineCore failed to start")
            self.failed = True
            self.input_socket.send_multipart(
                codec.encode(MessageType.STARTUP_FAILED, _failure(exc))
            )
            return None
        ready = ReadyInfo(
            num_kv_blocks=engine.num_kv_blocks,
            max_model_len=setup.config.scheduler.max_model_len,
            pid=os.getpid(),
        )
        self.input_socket.send_multipart(codec.encode(MessageType.READY, ready))
        return engine

    def serve(self, engine: EngineCore) -> None:
        threads = (
            (self._input_thread, "EngineCoreInput"),
            (self._output_thread, "EngineCoreOutput"),
        )
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        raise_in_loop_on_worker_death(engine, self.input_queue)
        try:
            EngineCoreLoop(
                engine, self.input_queue, lambda *message: self.output_queue.put(message)
            ).run()
            logger.info("EngineCore shut down")
        except BaseException as exc:
            logger.exception("EngineCore hit a fatal error")
            self.failed = True
            self.output_queue.put((MessageType.ENGINE_DEAD, _failure(exc)))
        finally:
            _shutdown_executor(engine)

    def _input_thread(self) -> None:
        codec = Codec()
        while not self._stop.is_set():
            if not self.input_socket.poll(IO_POLL_MS):
                continue
            frames = self.input_socket.recv_multipart(copy=True)
            try:
                self.input_queue.put(codec.decode_request(frames))
            except Exception:  # a malformed message must not kill the engine
                logger.exception("dropped a malformed message from the front end")

    def _output_thread(self) -> None:
        codec = Codec()  # this thread's own: encoders are not thread-safe
        while (message := self.output_queue.get()) is not None:
            self.output_socket.send_multipart(codec.encode(*message), copy=False)

    def close(self) -> None:
        # Order: stop reading, flush what is queued for the front end, then close sockets.
        self._stop.set()
        self.output_queue.put(None)
        for thread in self._threads:
            thread.join(timeout=2.0)
        if any(thread.is_alive() for thread in self._threads):
            # A PUSH send blocks forever once the front end has closed its end (it does so when it
            # learns the engine is dead). The process exits right after close(): leave the
            # sockets to the OS instead of hanging in ctx.term() on a socket that thread holds.
            logger.warning("EngineCore I/O thread did not stop; exiting without closing sockets")
            return
        self.input_socket.close(linger=CLOSE_LINGER_MS)
        self.output_socket.close(linger=CLOSE_LINGER_MS)
        self.ctx.term()


def _failure(exc: BaseException) -> EngineFailure:
    return EngineFailure(
        error_type=type(exc).__name__,
        message=str(exc) or type(exc).__name__,
        traceback="".join(traceback.format_exception(exc)),
    )
