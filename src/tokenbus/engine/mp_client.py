"""Clients for an EngineCore in its own process (L4).

The client binds two ZMQ sockets over `ipc://` in a private temp dir and spawns the engine:

    ROUTER (here, bind) ⇄ DEALER (engine)   requests out; the start-up handshake comes back here
    PULL   (here, bind) ← PUSH   (engine)   outputs, utility results, ENGINE_DEAD

Threads on this side: a reader (PULL → OutputChannel / utility futures) and a monitor that
waits on the process sentinel. When the engine dies, the monitor marks the connection dead at
once: every waiter — blocking or asyncio — gets EngineDeadError, and every later call raises it.

Lifetime: the threads and the finalizer hold the `EngineConnection`, never the client, so a
client that is dropped without `shutdown()` is garbage-collected and stops its engine; at
interpreter exit multiprocessing runs the finalizer before it joins its children.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from tokenbus.engine.core_client import EngineCoreClient, OutputChannel, UtilityCalls
from tokenbus.engine.core_proc import (
    IO_POLL_MS,
    STACK_DUMP_SIGNAL,
    EngineAddresses,
    EngineFactory,
    make_engine_core,
    run_engine_core,
)
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.messages import (
    Codec,
    Empty,
    EngineFailure,
    MessageType,
    ReadyInfo,
    RequestType,
)
from tokenbus.protocol import EngineOutputs, EngineRequest
from tokenbus.utils.ipc_dir import make_ipc_dir
from tokenbus.utils.spawn import start_process

if TYPE_CHECKING:
    from tokenbus.engine.setup import EngineSetup

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0  # model loading (and graph capture) on a slow machine
SHUTDOWN_TIMEOUT_S = 5.0  # a clean SHUTDOWN before we terminate, then kill
LATE_FAILURE_GRACE_MS = 1000  # an exited engine's STARTUP_FAILED may still be in flight
FINALIZER_PRIORITY = 100  # run at exit before multiprocessing joins its children (priority < 0)


class EngineConnection:
    """The engine process, its sockets and the state the background threads share."""

    def __init__(
        self,
        setup: EngineSetup,
        engine_factory: EngineFactory,
        outputs: OutputChannel | None = None,
        engine_index: int = 0,
    ) -> None:
        """`outputs`: a channel shared with other engines' connections (data parallelism),
        each EngineOutputs tagged with `engine_index`."""
        self.outputs = outputs if outputs is not None else OutputChannel()
        self.engine_index = engine_index
        self.utilities = UtilityCalls()
        self.dead_error: EngineDeadError | None = None
        self._dead_lock = threading.Lock()
        self._reap_lock = threading.Lock()  # see wait_exit
        self._closing = threading.Event()
        self._codec = Codec()  # used under _send_lock only: encoders are not thread-safe
        self._send_lock = threading.Lock()
        self._engine_identity: bytes | None = None  # the engine's route, learned at READY
        self._threads: list[threading.Thread] = []
        self.last_heard = time.monotonic()  # written by the reader thread (a float: atomic)
        self.ipc_dir = make_ipc_dir("tokenbus-")  # first removing those of dead servers
        addresses = EngineAddresses(f"ipc://{self.ipc_dir}/input", f"ipc://{self.ipc_dir}/output")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        # Fail (EHOSTUNREACH) instead of dropping silently when the engine is gone; never block.
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(addresses.input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(addresses.output_address)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            name="EngineCore",
            kwargs=dict(
                setup=setup,
                addresses=addresses,
                parent_pid=os.getpid(),
                engine_factory=engine_factory,
                log_level=logging.getLogger("tokenbus").getEffectiveLevel(),
            ),
        )
        start_process(self.proc)

    # ------------------------------------------------------------------ start-up
    def wait_ready(self, timeout_s: float) -> ReadyInfo:
        """Wait for READY; raise with the engine's own message on STARTUP_FAILED, on exit
        or on timeout — never hang."""
        poller = zmq.Poller()
        poller.register(self._input, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(remaining * 1000))
            if self._input in events:
                return self._read_handshake()
            if self.proc.sentinel in events:
                if self._input.poll(LATE_FAILURE_GRACE_MS):
                    return self._read_handshake()
                raise RuntimeError(
                    f"EngineCore process exited during start-up "
                    f"({_describe_exit(self.wait_exit(1.0))}); see its log above"
                )
        raise TimeoutError(f"EngineCore did not report ready within {timeout_s:.0f} s")

    def _read_handshake(self) -> ReadyInfo:
        identity, *frames = self._input.recv_multipart()
        kind, payload = self._codec.decode_message(frames)
        if kind is MessageType.READY:
            self._engine_identity = identity
            return payload
        if kind is MessageType.STARTUP_FAILED:
            raise _startup_error(payload)
        raise RuntimeError(f"EngineCore sent {kind.name} before READY")

    def start_threads(self) -> None:
        self._threads = [
            threading.Thread(target=self._read_outputs, name="EngineOutputReader", daemon=True),
            threading.Thread(target=self._monitor, name="EngineMonitor", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ background threads
    def _read_outputs(self) -> None:
        codec = Codec()
        while not self._closing.is_set():
            if not self._output.poll(IO_POLL_MS):
                continue
            try:
                kind, payload = codec.decode_message(self._output.recv_multipart())
            except Exception:
                logger.exception("dropped a malformed message from the EngineCore")
                continue
            self.last_heard = time.monotonic()
            if kind is MessageType.OUTPUTS:
                payload.engine_index = self.engine_index
                self.outputs.put(payload)
            elif kind is MessageType.UTILITY_RESULT:
                self.utilities.resolve(payload)
            elif kind is MessageType.ENGINE_DEAD:
                # The traceback is in the engine's log; callers (HTTP clients) get the summary.
                self.mark_dead(
                    EngineDeadError(f"EngineCore died: {payload.error_type}: {payload.message}")
                )

    def _monitor(self) -> None:
        multiprocessing.connection.wait([self.proc.sentinel])
        exitcode = self.wait_exit(1.0)  # reap it, for the exit code
        if not self._closing.is_set():
            self.mark_dead(
                EngineDeadError(
                    f"EngineCore process (pid {self.proc.pid}) died unexpectedly "
                    f"({_describe_exit(exitcode)}); see its log above for the root cause"
                )
            )

    def wait_exit(self, timeout_s: float | None) -> int | None:
        """Wait up to `timeout_s` (None: for ever) for the engine process to end; its exit
        code, or None while it runs. Every wait for or look at the process goes through here:
        multiprocessing's Popen is not thread-safe, and two threads in waitpid() at once can
        lose the exit status (one reaps, the other gets ECHILD and, if it looks before the
        first has stored the code, sees a process that is still running)."""
        with self._reap_lock:
            self.proc.join(timeout=timeout_s)
            return self.proc.exitcode

    def mark_dead(self, error: EngineDeadError) -> None:
        # The first cause wins (ENGINE_DEAD's text is better than the exit code that follows).
        with self._dead_lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
        if not self._closing.is_set():
            logger.error("%s", error)
        self.utilities.fail_all(error)
        self.outputs.put(error)

    # ------------------------------------------------------------------ requests
    def send(self, kind: RequestType, payload: Any) -> None:
        """Thread-safe and never blocks (a ROUTER drops or fails, it does not wait)."""
        if self.dead_error is not None:
            raise self.dead_error
        with self._send_lock:
            frames = self._codec.encode(kind, payload)
            try:
                self._input.send_multipart([self._engine_identity, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise self.dead_error or EngineDeadError(
                    f"cannot reach the EngineCore: {exc}"
                ) from exc

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Ask the engine to stop, then terminate, then kill; release sockets and the temp dir.
        Runs once (the client's finalizer)."""
        self._closing.set()
        # A ready engine gets a SHUTDOWN and time to exit; one still starting is terminated.
        is_ready = self._engine_identity is not None
        if is_ready and self.wait_exit(0) is None and self.dead_error is None:
            try:
                self.send(RequestType.SHUTDOWN, Empty())
            except EngineDeadError:
                pass
        self._stop_process(SHUTDOWN_TIMEOUT_S if is_ready else 0.0)
        self.mark_dead(EngineDeadError("the engine was shut down"))
        for thread in self._threads:
            thread.join(timeout=2.0)
        with self._send_lock:
            self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _stop_process(self, timeout_s: float) -> None:
        if self.wait_exit(timeout_s) is None:
            if timeout_s:
                logger.warning("EngineCore did not stop within %.0f s; terminating it", timeout_s)
            self._signal(kill=False)
            if self.wait_exit(SHUTDOWN_TIMEOUT_S) is None:
                self._signal(kill=True)
                self.wait_exit(None)

    def _signal(self, kill: bool) -> None:
        # Under the reap lock too: terminate()/kill() look at the exit code (a waitpid).
        with self._reap_lock:
            if self.proc.exitcode is None:
                (self.proc.kill if kill else self.proc.terminate)()


class MPClient(EngineCoreClient):
    """Starts the engine and owns its lifetime; the subclasses add the sync or asyncio half of
    the interface."""

    def __init__(
        self,
        setup: EngineSetup,
        engine_factory: EngineFactory = make_engine_core,
        ready_timeout_s: float | None = None,
        connection: EngineConnection | None = None,
        after_spawn: Callable[[], None] | None = None,
    ) -> None:
        """`connection`: an engine already spawned (data parallelism starts all first).
        `after_spawn`: called once the engine process has started, before waiting for READY."""
        self.setup = setup
        self._conn = conn = connection or EngineConnection(setup, engine_factory)
        self.proc = conn.proc
        # Holds the connection, not the client: runs on shutdown(), when the client is
        # garbage-collected, or at exit before multiprocessing joins its children.
        self._finalizer = multiprocessing.util.Finalize(
            self, conn.close, exitpriority=FINALIZER_PRIORITY
        )
        try:
            if after_spawn is not None:
                after_spawn()
            timeout_s = DEFAULT_READY_TIMEOUT_S if ready_timeout_s is None else ready_timeout_s
            self.ready = conn.wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.ready.num_kv_blocks
        conn.start_threads()

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._conn.dead_error

    def add_request(self, request: EngineRequest) -> None:
        self._conn.send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._conn.send(RequestType.ABORT, list(request_ids))

    def _start_utility(self, method: str, args: tuple) -> Future:
        call, future = self._conn.utilities.start(method, args)
        self._conn.send(RequestType.UTILITY, call)
        return future

    def call_utility(self, method: str, *args: Any) -> Any:
        """Blocking (LLMEngine, and data parallelism's sync half)."""
        return self._start_utility(method, args).result()

    def seconds_silent(self) -> list[float]:
        return [time.monotonic() - self._conn.last_heard]

    def dump_engine_stacks(self) -> None:
        try:
            os.kill(self.proc.pid, STACK_DUMP_SIGNAL)
        except (OSError, TypeError):  # gone already (its death is reported elsewhere)
            pass

    def shutdown(self) -> None:
        """Stop the engine process; idempotent. Waiters get EngineDeadError."""
        self._finalizer()

    def wait_engine_exit(self, timeout_s: float | None) -> int | None:
        """The engine process's exit code once it has ended (waiting up to `timeout_s`), else
        None."""
        return self._conn.wait_exit(timeout_s)


class SyncMPClient(MPClient):
    """For LLMEngine: blocking calls."""

    def get_output(self) -> EngineOutputs:
        return self._conn.outputs.get()


class AsyncMPClient(MPClient):
    """For AsyncLLM: coroutines on the caller's event loop. Sends never block, so the sync
    add_request/abort_requests are safe to call from the loop too (e.g. during cancellation)."""

    async def add_request_async(self, request: EngineRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineOutputs:
        return await self._conn.outputs.get_async()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._start_utility(method, args))


def _startup_error(failure: EngineFailure) -> Exception:
    # A ValueError (a config the engine cannot run, e.g. a KV cache too small for one request)
    # stays a ValueError with the same text, as when the engine is built in-process.
    if failure.error_type == "ValueError":
        return ValueError(failure.message)
    return RuntimeError(f"EngineCore failed to start: {failure.error_type}: {failure.message}")


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
