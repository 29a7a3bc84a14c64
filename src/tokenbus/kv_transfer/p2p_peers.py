"""P2PConnector's transfer threads (L2), driven by the worker half in p2p.py: a prefiller's
sender (a BlockServer answering handshakes, pulls and DONEs for registered sends) and a
decoder's receiver (a puller thread per peer)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from tokenbus.kv_transfer.base import ConnectorContext, KVLayout, TransferCounters
from tokenbus.kv_transfer.p2p_config import LoadJob, P2PSettings, SendSpec
from tokenbus.kv_transfer.p2p_transport import (
    ERROR,
    NOT_READY,
    OK,
    BlockServer,
    Done,
    Hello,
    Message,
    PeerClient,
    Pull,
    Reply,
    TransportError,
)

logger = logging.getLogger(__name__)

NOT_READY_RETRY_S = 0.05  # a Pull that came before the prefiller registered the request


def handshake_reply(layout: KVLayout, engine_id: str, hello: Hello) -> Reply:
    """A prefiller's answer to a peer's Hello: OK if their pools' blocks are interchangeable,
    else an error naming every field that differs."""
    mismatch = layout.mismatch(hello.layout)
    if mismatch is None:
        return Reply(seq=hello.seq, status=OK, engine_id=engine_id)
    message = (
        f"engine {engine_id} refuses engine {hello.engine_id}: KV layouts differ "
        f"({mismatch}; 'ours' is {engine_id}'s)"
    )
    logger.error("P2P handshake: %s", message)
    return Reply(seq=hello.seq, status=ERROR, message=message)


@dataclass
class _PendingSend:
    spec: SendSpec
    deadline: float  # time.monotonic() after which it is freed unpulled


class _Sender:
    """Producer side: serves the blocks of requests the scheduler registered, and only those,
    until their DONE or abort_timeout_s. The server thread and the runner thread share the
    state under one lock (a read holds it, so a timeout never frees blocks mid-read)."""

    def __init__(
        self,
        ctx: ConnectorContext,
        settings: P2PSettings,
        zmq_ctx: zmq.Context,
        read_blocks: Callable[[list[int]], torch.Tensor],
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self._read_blocks = read_blocks
        self._lock = threading.Lock()
        self._pending: dict[str, _PendingSend] = {}
        self._finished: set[str] = set()  # DONE or timed out, not reported yet
        self._gone: dict[str, float] = {}  # finished recently → when: a late Pull fails at once
        self._counters = TransferCounters()
        self._server = BlockServer(zmq_ctx, settings.host, settings.port, self.handle)

    def register(self, sends: dict[str, SendSpec]) -> None:
        deadline = time.monotonic() + self.settings.abort_timeout_s
        with self._lock:
            for req_id, spec in sends.items():
                self._pending[req_id] = _PendingSend(spec, deadline)

    def take_finished(self, counters: TransferCounters) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for req_id in [r for r, send in self._pending.items() if now >= send.deadline]:
                logger.warning(
                    "P2P: nobody pulled request %s's KV within abort_timeout_s=%gs; freeing "
                    "its blocks",
                    req_id,
                    self.settings.abort_timeout_s,
                )
                self._finish(req_id, now)
            for req_id in [
                r for r, when in self._gone.items() if now - when > self.settings.abort_timeout_s
            ]:
                del self._gone[req_id]
            finished, self._finished = self._finished, set()
            counters.bytes_saved += self._counters.bytes_saved
            counters.save_seconds += self._counters.save_seconds
            self._counters = TransferCounters()
        return finished

    def _finish(self, req_id: str, now: float) -> None:
        del self._pending[req_id]
        self._finished.add(req_id)
        self._gone[req_id] = now

    def handle(self, message: Message) -> tuple[Reply, torch.Tensor | None]:
        """On the server thread: answer one peer's message."""
        if isinstance(message, Hello):
            return handshake_reply(self.ctx.layout, self.ctx.engine_id, message), None
        if message.engine_id != self.ctx.engine_id:
            return _error(
                message, f"this is engine {self.ctx.engine_id}, not {message.engine_id}"
            ), None
        with self._lock:
            send = self._pending.get(message.request_id)
            if send is None:
                if message.request_id not in self._gone:
                    return Reply(
                        seq=message.seq, status=NOT_READY
                    ), None  # its metadata is a step late
                if isinstance(message, Done):
                    return Reply(seq=message.seq, status=OK), None
                return _error(
                    message,
                    f"request {message.request_id}'s blocks are no longer held "
                    f"(sent, or not pulled within abort_timeout_s)",
                ), None
            if isinstance(message, Done):
                self._finish(message.request_id, time.monotonic())
                return Reply(seq=message.seq, status=OK), None
            return self._serve_pull(message, send)

    def _serve_pull(self, pull: Pull, send: _PendingSend) -> tuple[Reply, torch.Tensor | None]:
        # A decoder with a local prefix hit pulls the rest: the registered blocks' tail, in order
        # (out of order or repeated, they would land as wrong K/V at the decoder's positions).
        block_ids = send.spec.block_ids
        if (
            not pull.block_ids
            or pull.block_ids != block_ids[len(block_ids) - len(pull.block_ids) :]
        ):
            return _error(
                pull,
                f"blocks {pull.block_ids[:64]} are not the tail of request "
                f"{pull.request_id}'s prompt blocks",
            ), None
        if pull.prompt_digest != send.spec.prompt_digest:
            return _error(
                pull, f"request {pull.request_id} prefilled another prompt than the puller's"
            ), None
        started = time.perf_counter()
        kv = self._read_blocks(pull.block_ids).cpu().contiguous()  # [L, 2, n, block_size, Hkv, D]
        data = kv.reshape(-1).view(torch.uint8)  # bf16 and friends travel as bytes
        self._counters.timed_save(data.numel(), started)
        return Reply(
            seq=pull.seq,
            status=OK,
            dtype=str(kv.dtype).removeprefix("torch."),
            shape=list(kv.shape),
            nbytes=data.numel(),
        ), data

    def close(self) -> bool:
        return self._server.close()


def _error(message: Message, text: str) -> Reply:
    return Reply(seq=message.seq, status=ERROR, message=text)


@dataclass
class _Job:
    spec: LoadJob
    started: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)  # its request was aborted


@dataclass
class _Result:
    job: _Job
    kv: torch.Tensor | None  # [L, 2, n, block_size, Hkv, D] on the CPU; None: the load failed


class _Receiver:
    """Consumer side: the runner thread hands jobs to a puller thread per peer and, in
    take_finished, writes what came back into the pool. It alone decides when a job is
    reported, so each is reported once: on its result, or at once when its request finished."""

    def __init__(self, ctx: ConnectorContext, settings: P2PSettings, zmq_ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.settings = settings
        self._zmq = zmq_ctx
        self._loading: dict[str, _Job] = {}
        self._results: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._pullers: dict[tuple[str, int], _Puller] = {}

    def submit(self, specs: list[LoadJob]) -> None:
        for spec in specs:
            job = _Job(spec)
            self._loading[spec.request_id] = job
            peer = (spec.remote_host, spec.remote_port)
            if peer not in self._pullers:
                self._pullers[peer] = _Puller(
                    self.ctx, self.settings, self._zmq, *peer, self._results
                )
            self._pullers[peer].jobs.put(job)

    def take_finished(
        self,
        finished_req_ids: set[str],
        counters: TransferCounters,
        write_blocks: Callable[[list[int], torch.Tensor], None],
    ) -> set[str]:
        done = set()
        for req_id in finished_req_ids:  # aborted while loading: nothing will write its blocks
            job = self._loading.pop(req_id, None)
            if job is not None:
                job.cancelled.set()  # its puller still tells the prefiller DONE
                done.add(req_id)
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return done
            req_id = result.job.spec.request_id
            if self._loading.get(req_id) is not result.job:
                continue  # cancelled: reported already
            del self._loading[req_id]
            done.add(req_id)
            if not self._write(result, write_blocks, counters):
                counters.invalid_block_ids.update(result.job.spec.local_block_ids)

    def _write(self, result: _Result, write_blocks, counters: TransferCounters) -> bool:
        if result.kv is None:
            return False
        try:
            write_blocks(result.job.spec.local_block_ids, result.kv)
        except Exception:
            logger.exception(
                "P2P: writing request %s's KV into the pool failed", result.job.spec.request_id
            )
            return False
        counters.timed_load(result.kv.numel() * result.kv.element_size(), result.job.started)
        return True

    def close(self) -> bool:
        return all([puller.close() for puller in self._pullers.values()])


class _Puller:
    """One thread and one connection per prefiller: handshake once, then its jobs in turn."""

    def __init__(
        self,
        ctx: ConnectorContext,
        settings: P2PSettings,
        zmq_ctx: zmq.Context,
        host: str,
        port: int,
        results: queue.SimpleQueue[_Result],
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._results = results
        self._stop = threading.Event()
        self._client = PeerClient(zmq_ctx, host, port, self._stop)
        self._unanswered_at = float("-inf")  # when the peer last let a request time out
        self._thread = threading.Thread(
            target=self._run, name=f"p2p-pull-{host}:{port}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while (job := self.jobs.get()) is not None and not self._stop.is_set():
                self._load(job)
        finally:
            self._client.close()

    def _load(self, job: _Job) -> None:
        delay = self.settings.debug_delay_pull_s
        if delay:
            job.cancelled.wait(delay)
        deadline = time.monotonic() + self.settings.pull_timeout_s
        try:
            if job.started <= self._unanswered_at:
                # It waited behind a request the peer never answered: a dead peer would make each
                # job in the queue wait pull_timeout_s in turn.
                raise TransportError(f"{self._client.address} did not answer an earlier request")
            kv = self._pull(job, deadline)
        except TransportError as exc:
            if isinstance(exc, _NoAnswer):
                self._unanswered_at = time.perf_counter()
            logger.error(
                "P2P: loading request %s's KV from engine %s at %s failed (%s); it is "
                "recomputed or fails per kv_load_failure_policy",
                job.spec.request_id,
                job.spec.remote_engine_id,
                self._client.address,
                exc,
            )
            self._results.put(_Result(job, None))
            if isinstance(exc, _Refused):  # the peer answers: it may free the blocks now
                self._send_done(job)
            return
        except Exception:  # a bug: the job must still be reported, the thread must live on
            logger.exception("P2P: loading request %s's KV failed", job.spec.request_id)
            self._client.reset()
            self._results.put(_Result(job, None))
            return
        if kv is not None:
            self._results.put(_Result(job, kv))
        self._send_done(job)

    def _pull(self, job: _Job, deadline: float) -> torch.Tensor | None:
        """The job's blocks, or None if its request was aborted meanwhile."""
        spec = job.spec
        if job.cancelled.is_set():
            return None
        # Again when the job names another engine: one restarted on the same port may differ.
        if self._client.greeted_engine_id != spec.remote_engine_id:
            reply, _ = self._call(
                Hello(seq=0, engine_id=self.ctx.engine_id, layout=self.ctx.layout.describe()),
                deadline,
            )
            if reply.status != OK:
                raise _Refused(f"handshake refused: {reply.message}")
            self._client.greeted_engine_id = reply.engine_id
        pull = Pull(
            seq=0,
            engine_id=spec.remote_engine_id,
            request_id=spec.remote_request_id,
            block_ids=spec.remote_block_ids,
            prompt_digest=spec.prompt_digest,
        )
        expected = len(spec.local_block_ids) * self.ctx.layout.block_nbytes
        while not job.cancelled.is_set():
            reply, data = self._call(pull, deadline, expected)
            if reply.status == OK:
                return self._blocks(reply, data, len(spec.local_block_ids))
            if reply.status != NOT_READY:
                raise _Refused(reply.message)
            if time.monotonic() + NOT_READY_RETRY_S >= deadline:
                raise TransportError(
                    f"request {spec.remote_request_id} not known there within pull_timeout_s"
                )
            job.cancelled.wait(NOT_READY_RETRY_S)
        return None

    def _call(
        self, message: Message, deadline: float, max_reply_bytes: int = 0
    ) -> tuple[Reply, torch.Tensor | None]:
        try:
            return self._client.call(message, deadline, max_reply_bytes)
        except TransportError as exc:
            raise _NoAnswer(str(exc)) from exc

    def _blocks(self, reply: Reply, data: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """The reply's bytes as K/V [L, 2, n, block_size, Hkv, row], checked against our
        layout (row: head_dim values of its dtype, kv_quant.py)."""
        layout = self.ctx.layout
        shape = layout.block_shape
        shape.insert(2, num_blocks)
        stored = layout.storage_dtype
        if reply.dtype != stored or reply.shape != shape:
            raise _Refused(f"got {reply.dtype} {reply.shape}, expected {stored} {shape}")
        if data.numel() != num_blocks * layout.block_nbytes:
            raise _Refused(f"got {data.numel()} bytes for {stored} {shape}")
        return data.view(getattr(torch, stored)).view(shape)

    def _send_done(self, job: _Job) -> None:
        """Tell the prefiller it may free the blocks; if it cannot hear it, its timeout does."""
        deadline = time.monotonic() + self.settings.pull_timeout_s
        done = Done(
            seq=0, engine_id=job.spec.remote_engine_id, request_id=job.spec.remote_request_id
        )
        try:
            while (reply := self._client.call(done, deadline)[0]).status == NOT_READY:
                if time.monotonic() + NOT_READY_RETRY_S >= deadline:
                    raise TransportError("request not known there")
                time.sleep(NOT_READY_RETRY_S)
        except TransportError as exc:
            logger.warning(
                "P2P: DONE for request %s to %s not delivered (%s); the prefiller frees it "
                "after its abort_timeout_s",
                job.spec.remote_request_id,
                self._client.address,
                exc,
            )
            return
        if reply.status != OK:
            logger.warning(
                "P2P: DONE for request %s refused by %s: %s",
                job.spec.remote_request_id,
                self._client.address,
                reply.message,
            )

    def close(self) -> bool:
        self._stop.set()
        self.jobs.put(None)
        self._thread.join(timeout=5)
        return not self._thread.is_alive()


class _NoAnswer(TransportError):
    """The peer sent no (usable) reply in time."""


class _Refused(TransportError):
    """The peer answered, but not with the blocks (an error, a refused handshake, wrong shape)."""
