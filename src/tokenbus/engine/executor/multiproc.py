"""MultiProcExecutor: one spawned process per tensor-parallel rank (L4).

    EngineCore ──► each step's SchedulerOutput, msgpack-encoded ONCE, the same frame pushed to
                   every rank's socket (PUSH → PULL, ipc://; nothing is lost before a rank connects)
    rank 0 ──────► ModelRunnerOutput (PUSH → the executor's PULL); other ranks reply only to RPCs

Ranks join one torch.distributed group (gloo on CPU, nccl on CUDA) for the model's
collectives; this channel carries only control and the step's inputs and outputs. Every
message is a msgspec Struct, never a pickle.

A rank that dies is noticed at once: a monitor thread waits on every process sentinel and calls
the failure callback (the EngineCore loop raises, so every waiter gets the engine-dead error),
and a wait for replies checks the same flag every POLL_MS, so nothing hangs on a dead rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from tokenbus.config import EngineConfig
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.engine.executor.abstract import Executor
from tokenbus.model_arch import ModelArch
from tokenbus.utils.ipc_dir import make_ipc_dir
from tokenbus.utils.parent_watch import start_parent_watch
from tokenbus.utils.spawn import start_process

if TYPE_CHECKING:
    from tokenbus.loader import ModelSource

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for replies looks at the ranks' health
READY_TIMEOUT_S = 600.0  # a rank's device + model phases (load_model) must finish by then
# A step or RPC that no rank answers by then is a hung rank: the engine fails instead of waiting
# for ever (a dead rank is noticed at once by its sentinel; this catches live but stuck ones).
CALL_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 5.0  # after SHUTDOWN, before a rank is terminated
DEATH_GRACE_S = 1.0  # how long a failed collective waits to learn which rank died


class RpcCall(msgspec.Struct, tag="rpc", array_like=True):
    method: str
    args: list[Any] = []


class StepCall(msgspec.Struct, tag="step", array_like=True):
    scheduler_output: SchedulerOutput


class ShutdownCall(msgspec.Struct, tag="shutdown", array_like=True):
    pass


WorkerCall = RpcCall | StepCall | ShutdownCall


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True):
    rank: int
    value: msgspec.Raw  # the call's result, already encoded (a step's ModelRunnerOutput)
    error_type: str | None = None  # the exception's class name when the call raised
    error: str | None = None


class WorkerFailedError(RuntimeError):
    """A rank died, or a step failed on one."""


class MultiProcExecutor(Executor):
    def __init__(
        self, config: EngineConfig, source: ModelSource, arch: ModelArch, eos_token_id: int | None
    ) -> None:
        self.world_size = config.parallel.world_size
        self._encoder = msgspec.msgpack.Encoder()
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._failure: str | None = None
        self._died = threading.Event()
        self._failure_callbacks: list[Callable[[], None]] = []
        self._closing = False
        self._ipc_dir = make_ipc_dir("tokenbus-tp-")
        self._ctx = zmq.Context()
        self._result_socket = self._ctx.socket(zmq.PULL)
        result_address = f"ipc://{self._ipc_dir}/results"
        self._result_socket.bind(result_address)
        self._call_sockets, self._procs = [], []
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        spawn = multiprocessing.get_context("spawn")
        try:
            for rank in range(self.world_size):
                call_address = f"ipc://{self._ipc_dir}/calls-{rank}"
                sock = self._ctx.socket(zmq.PUSH)
                # a send to a dead rank must not block for ever
                sock.setsockopt(zmq.SNDTIMEO, POLL_MS)
                sock.bind(call_address)
                self._call_sockets.append(sock)
                proc = spawn.Process(
                    target=run_worker,
                    name=f"TPWorker-{rank}",
                    daemon=True,
                    args=(
                        config,
                        source,
                        arch,
                        eos_token_id,
                        rank,
                        init_method,
                        call_address,
                        result_address,
                        os.getpid(),
                    ),
                )
                start_process(proc)
                self._procs.append(proc)
            self._monitor = threading.Thread(
                target=self._watch_ranks, name="TPWorkerMonitor", daemon=True
            )
            self._monitor.start()
            self._gather(READY_TIMEOUT_S)  # every rank's init_device + load_model
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ Executor
    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        self._failure_callbacks.append(callback)
        if self._failure is not None:
            callback()

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if kwargs:
            raise ValueError(
                "collective_rpc: the multi-process executor takes positional args only"
            )
        self._broadcast(RpcCall(method, list(args)))
        return [msgspec.msgpack.decode(reply.value) for reply in self._gather(CALL_TIMEOUT_S)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(StepCall(scheduler_output))
        (reply,) = self._gather(CALL_TIMEOUT_S, ranks=(0,))
        return self._output_decoder.decode(reply.value)

    def check_health(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        frame = self._encoder.encode(ShutdownCall())
        for sock in self._call_sockets:
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that rank is gone or not reading: terminated below
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for sock in [*self._call_sockets, self._result_socket]:
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # ------------------------------------------------------------------ plumbing
    def _broadcast(self, call: RpcCall | StepCall) -> None:
        self.check_health()
        frame = self._encoder.encode(call)  # once, whatever the number of ranks
        for sock in self._call_sockets:
            while True:
                try:
                    sock.send(frame, copy=False)
                    break
                except zmq.Again:  # that rank is not reading: dead (raises) or busy (retry)
                    self.check_health()

    def _gather(
        self, timeout_s: float | None = None, ranks: tuple[int, ...] | None = None
    ) -> list[WorkerReply]:
        """Replies from `ranks` (default: all) in rank order; raises as soon as a rank fails."""
        waiting = set(range(self.world_size) if ranks is None else ranks)
        replies: dict[int, WorkerReply] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            # Replies already queued first: a rank's last words (its start-up error) beat the
            # news of its exit.
            if not self._result_socket.poll(0):
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerFailedError(
                        f"tensor-parallel ranks {sorted(waiting)} did not answer within "
                        f"{timeout_s:.0f} s (hung)"
                    )
                if not self._result_socket.poll(POLL_MS):
                    continue
            reply = self._reply_decoder.decode(self._result_socket.recv(copy=False).buffer)
            if reply.error is not None:
                self._raise_reply_error(reply)
            if reply.rank in waiting:  # a stray reply (a rank not asked) is dropped
                waiting.discard(reply.rank)
                replies[reply.rank] = reply
        return [replies[rank] for rank in sorted(replies)]

    def _raise_reply_error(self, reply: WorkerReply) -> None:
        # A rank that dies mid-step makes its peers' collectives fail first: wait a moment for
        # the monitor, so the error names the dead rank rather than the symptom.
        if reply.error_type != "ValueError" and self._died.wait(DEATH_GRACE_S):
            raise WorkerFailedError(f"{self._failure}; {reply_error(reply)}")
        raise reply_error(reply)

    def _watch_ranks(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        self._failure = (
            f"tensor-parallel worker rank {rank} died (exit code {self._procs[rank].exitcode})"
        )
        logger.error(self._failure)
        self._died.set()
        for callback in self._failure_callbacks:
            callback()


def reply_error(reply: WorkerReply) -> Exception:
    """A rank's ValueError (bad configuration: KV too small, a bad draft model) stays a
    ValueError for the front end; anything else is a worker failure."""
    message = f"tensor-parallel rank {reply.rank}: {reply.error}"
    return ValueError(message) if reply.error_type == "ValueError" else WorkerFailedError(message)


def encode_reply(
    encoder: msgspec.msgpack.Encoder, rank: int, value: Any = None, exc: BaseException | None = None
) -> bytes:
    """A WorkerReply carrying `value` (encoded once, into the reply) or the exception's text."""
    if exc is not None:
        return encoder.encode(
            WorkerReply(
                rank,
                msgspec.Raw(encoder.encode(None)),
                error_type=type(exc).__name__,
                error=str(exc) or type(exc).__name__,
            )
        )
    return encoder.encode(WorkerReply(rank, msgspec.Raw(encoder.encode(value))))


def dispatch_call(worker: Any, call: RpcCall | StepCall) -> Any:
    """Run one call on a rank's Worker: a step (None off rank 0) or a public method."""
    if isinstance(call, StepCall):
        return worker.execute_model(call.scheduler_output)
    if call.method.startswith("_") or not callable(getattr(worker, call.method, None)):
        raise ValueError(f"collective_rpc: {call.method!r} is not a public worker method")
    return getattr(worker, call.method)(*call.args)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------- the rank process
def run_worker(
    config: EngineConfig,
    source: ModelSource,
    arch: ModelArch,
    eos_token_id: int | None,
    rank: int,
    init_method: str,
    call_address: str,
    result_address: str,
    parent_pid: int,
) -> None:
    """Entry point of one rank: build the Worker (device, model), then serve calls until
    SHUTDOWN."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"(TPWorker rank={rank} pid=%(process)d) %(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when we stop
    start_parent_watch(parent_pid, f"TPWorkerParentWatch-{rank}")
    ctx = zmq.Context()
    calls = ctx.socket(zmq.PULL)
    calls.connect(call_address)
    results = ctx.socket(zmq.PUSH)
    results.connect(result_address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(WorkerCall)

    def reply(value: Any = None, exc: BaseException | None = None) -> None:
        results.send(encode_reply(encoder, rank, value, exc))

    from tokenbus.worker.worker import Worker

    worker = Worker(
        config, source, arch, eos_token_id, rank=rank, distributed_init_method=init_method
    )
    try:
        worker.init_device()
        worker.load_model()
        reply()
    except BaseException as exc:
        logger.exception("rank %d failed to start", rank)
        reply(exc=exc)
        results.close(linger=1000)  # let the reply leave before the process does
        os._exit(1)
    _serve(worker, rank, calls, decoder, reply)
    worker.shutdown()
    results.close(linger=1000)
    os._exit(0)


def _serve(
    worker,
    rank: int,
    calls: zmq.Socket,
    decoder: msgspec.msgpack.Decoder,
    reply: Callable[..., None],
) -> None:
    while True:
        call = decoder.decode(calls.recv(copy=False).buffer)
        if isinstance(call, ShutdownCall):
            return
        try:
            value = dispatch_call(worker, call)
            if isinstance(call, RpcCall) or rank == 0:  # only rank 0 reports a step
                reply(value)
        except Exception as exc:
            # A failed step leaves this rank's state out of step with the others: report it
            # (the engine dies with the message) and keep serving so shutdown is orderly.
            logger.exception("rank %d: %s failed", rank, type(call).__name__)
            reply(exc=exc)
