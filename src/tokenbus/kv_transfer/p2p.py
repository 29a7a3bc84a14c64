"""P2PConnector (L2): a decoder pulls a prefiller's prompt KV over the network (vLLM's
NIXL-style pull flow, our code; ZMQ over TCP as the transport, see p2p_transport.py).

    prefiller: --kv-transfer-config '{"kv_connector": "P2PConnector", "kv_role": "kv_producer",
                   "kv_connector_extra_config": {"kv_host": "10.0.0.1", "kv_port": 14579}}'
    decoder:   --kv-transfer-config '{"kv_connector": "P2PConnector", "kv_role": "kv_consumer"}'

1. A client sends the prefiller its request with kv_transfer_params {"do_remote_decode": true}
   (and max_tokens 1). When it finishes normally, the prefiller keeps the prompt's blocks (a
   delayed free) and answers with kv_transfer_params {"do_remote_prefill": true,
   "remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
   "remote_num_tokens"}; its worker half learns from the next step's metadata that it may serve
   those blocks (and no others).
2. The client sends the same prompt with those params to the decoder. Its scheduler half claims
   the prompt past the local prefix hit as an asynchronous load: the request takes its blocks
   and waits (WAITING_FOR_REMOTE_KVS). Its worker half pulls in a background thread per peer
   (a handshake first: both pools' KVLayout must agree), sends DONE, and on the runner thread,
   after the step's forward, writes the blocks into the pool and reports the load done. The
   scheduler then computes only the last prompt token again (for its logits).
3. DONE, or abort_timeout_s without one, frees the prefiller's blocks.

A failed load (peer dead, refusing or too slow) reports the job's blocks invalid: the request
recomputes them or fails (kv_load_failure_policy). Every load started is reported done exactly
once, also when the request was aborted meanwhile.

kv_connector_extra_config: kv_host (127.0.0.1) and kv_port (14579): where a producer serves;
kv_advertise_host (kv_host): the host decoders are told; abort_timeout_s (120): a pending send
nobody pulls is freed after it; pull_timeout_s (10): a load gives up after it;
debug_delay_pull_s (0): tests only, a decoder waits this long before each pull; kv_peer_hosts
(loopback): the prefiller hosts a decoder may pull from (request params come from clients),
["*"] for any.

One worker per engine (tensor_parallel_size 1); data-parallel engine d serves on kv_port + d.
The server authenticates nobody: keep prefillers on a private network, and list them in the
decoders' kv_peer_hosts.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import msgspec
import torch
import zmq

from tokenbus.core.request import RequestStatus
from tokenbus.kv_transfer.base import ConnectorContext, KVConnectorWorker, KVLayout, TransferCounters
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
from tokenbus.utils import cdiv

if TYPE_CHECKING:
    from tokenbus.core.outputs import KVConnectorOutput
    from tokenbus.core.request import Request
    from tokenbus.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_KV_PORT = 14579
NOT_READY_RETRY_S = 0.05  # a Pull that came before the prefiller registered the request
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_SENT_NORMALLY = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(frozen=True)
class P2PSettings:
    """kv_connector_extra_config of the P2PConnector, validated once."""

    host: str
    port: int
    advertise_host: str
    abort_timeout_s: float
    pull_timeout_s: float
    debug_delay_pull_s: float
    # Hosts a decoder may pull from: request params come from clients, and a decoder must not
    # be pointed at arbitrary hosts of its network. "*" allows any.
    peer_hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def allows_peer(self, host: str) -> bool:
        return "*" in self.peer_hosts or host in self.peer_hosts

    @classmethod
    def from_extra(cls, extra: dict, port_offset: int = 0) -> "P2PSettings":
        """`port_offset`: data-parallel engine d serves on kv_port + d."""
        host = extra.get("kv_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError("kv_connector_extra_config.kv_host must be a host name or address")
        port = extra.get("kv_port", DEFAULT_KV_PORT)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port + port_offset < 65536:
            raise ValueError(f"kv_connector_extra_config.kv_port must be a port number, got {port!r}")
        port += port_offset
        advertise_host = extra.get("kv_advertise_host", host)
        if not isinstance(advertise_host, str) or not advertise_host:
            raise ValueError("kv_connector_extra_config.kv_advertise_host must be a host name or address")
        peer_hosts = extra.get("kv_peer_hosts", list(LOOPBACK_HOSTS))
        if not isinstance(peer_hosts, list) or not all(isinstance(h, str) and h for h in peer_hosts):
            raise ValueError("kv_connector_extra_config.kv_peer_hosts must be a list of host names "
                             "or addresses (\"*\": any)")
        return cls(host, port, advertise_host,
                   _seconds(extra, "abort_timeout_s", 120.0, positive=True),
                   _seconds(extra, "pull_timeout_s", 10.0, positive=True),
                   _seconds(extra, "debug_delay_pull_s", 0.0, positive=False),
                   tuple(peer_hosts))


def _seconds(extra: dict, key: str, default: float, positive: bool) -> float:
    value = extra.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (positive and value == 0):
        raise ValueError(f"kv_connector_extra_config.{key} must be a {'positive' if positive else 'non-negative'} "
                         f"number of seconds, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------- scheduler → worker
class LoadJob(msgspec.Struct, array_like=True):
    """Pull `remote_block_ids` of a prefiller's request into `local_block_ids` (same order)."""

    request_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: list[int]
    prompt_digest: str  # of the decoder's prompt: the prefiller serves only the same prompt's KV


class SendSpec(msgspec.Struct, array_like=True):
    """A finished prefill's blocks that the prefiller may serve, and its prompt's digest."""

    block_ids: list[int]
    prompt_digest: str


class P2PMeta(msgspec.Struct, array_like=True, omit_defaults=True):
    loads: list[LoadJob] = []  # decoder: new loads
    sends: dict[str, SendSpec] = {}  # prefiller: request id → what it may serve now


def prompt_digest(prompt_token_ids: list[int]) -> str:
    """Names a prompt's tokens. A decoder's params come from a client, which could pair one
    prompt with another's prefill: the prefiller compares digests and refuses a mismatch."""
    return hashlib.sha256(msgspec.msgpack.encode(prompt_token_ids)).hexdigest()


@dataclass(frozen=True)
class RemotePrefill:
    """A decoder request's kv_transfer_params, checked (they come from a client)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: list[int]
    num_tokens: int

    @classmethod
    def parse(cls, params: dict | None) -> "RemotePrefill | None":
        """None if the params do not ask for a remote prefill; ValueError if they do, badly."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        fields = {"remote_engine_id": str, "remote_host": str, "remote_port": int,
                  "remote_request_id": str, "remote_block_ids": list, "remote_num_tokens": int}
        for key, kind in fields.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{key} is missing or not a {kind.__name__}")
        if not 0 < params["remote_port"] < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        block_ids = params["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids")
        return cls(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                   params["remote_request_id"], list(block_ids), params["remote_num_tokens"])


# ---------------------------------------------------------------------- scheduler half
class P2PScheduler:
    """KVConnectorScheduler: a producer keeps finished prompts' blocks for a pull; a consumer
    turns a request's remote-prefill params into an asynchronous load."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.block_size = ctx.layout.block_size
        self.settings = P2PSettings.from_extra(ctx.extra, port_offset=ctx.data_parallel_rank)
        self._new_sends: dict[str, SendSpec] = {}  # finished, for the worker to serve
        self._new_loads: list[LoadJob] = []
        # Requests a load was started for: never a second (after a preemption the prefiller has
        # freed its blocks; the loaded ones are local prefix hits by then).
        self._load_started: set[str] = set()
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ consumer
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not self.ctx.config.is_consumer or request.request_id in self._load_started:
            return 0, False
        remote = self._remote_prefill(request)
        if remote is None or num_computed_tokens >= request.num_prompt_tokens:
            return 0, False
        # The whole prompt: the scheduler computes its last token again for the logits.
        return request.num_prompt_tokens - num_computed_tokens, True

    def _remote_prefill(self, request: "Request") -> RemotePrefill | None:
        try:
            remote = RemotePrefill.parse(request.kv_transfer_params)
        except ValueError as exc:
            self._warn_once(request, f"{exc}; computing the prompt locally")
            return None
        if remote is not None and not self.settings.allows_peer(remote.host):
            self._warn_once(request, f"remote_host {remote.host!r} is not in kv_peer_hosts "
                                     f"{list(self.settings.peer_hosts)}; computing the prompt locally")
            return None
        if remote is not None and remote.num_tokens != request.num_prompt_tokens:
            self._warn_once(request, f"the prefiller computed {remote.num_tokens} tokens but the prompt has "
                                     f"{request.num_prompt_tokens}; computing it locally")
            return None
        return remote

    def _warn_once(self, request: "Request", message: str) -> None:
        if request.request_id not in self._warned:  # asked again each step while it waits
            self._warned.add(request.request_id)
            logger.warning("request %s: %s", request.request_id, message)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        remote = self._remote_prefill(request)
        if num_external_tokens == 0 or remote is None:
            return
        # The local prefix hit is whole blocks; the load fills the rest of the prompt's blocks.
        first = request.num_computed_tokens // self.block_size
        end = cdiv(request.num_prompt_tokens, self.block_size)
        self._new_loads.append(LoadJob(
            request_id=request.request_id, local_block_ids=block_ids[first:end],
            remote_engine_id=remote.engine_id, remote_host=remote.host, remote_port=remote.port,
            remote_request_id=remote.request_id, remote_block_ids=remote.block_ids[first:end],
            prompt_digest=prompt_digest(request.prompt_token_ids)))
        self._load_started.add(request.request_id)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> bytes | None:
        if not self._new_loads and not self._new_sends:
            return None
        meta = P2PMeta(loads=self._new_loads, sends=self._new_sends)
        self._new_loads, self._new_sends = [], {}
        return msgspec.msgpack.encode(meta)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        pass  # the scheduler frees what the worker reports sent; nothing else to track

    def tier_occupancy(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ producer
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        self._load_started.discard(request.request_id)
        self._warned.discard(request.request_id)
        params = request.kv_transfer_params
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        if (not self.ctx.config.is_producer or not isinstance(params, dict)
                or not params.get("do_remote_decode") or request.status not in _SENT_NORMALLY
                # Stopped by the front end after a preemption: the prompt's KV is gone.
                or request.num_computed_tokens < request.num_prompt_tokens or len(block_ids) < num_blocks):
            return False, None
        prompt_block_ids = list(block_ids[:num_blocks])
        self._new_sends[request.request_id] = SendSpec(prompt_block_ids, prompt_digest(request.prompt_token_ids))
        return True, {"do_remote_prefill": True, "remote_engine_id": self.ctx.engine_id,
                      "remote_host": self.settings.advertise_host, "remote_port": self.settings.port,
                      "remote_request_id": request.request_id, "remote_block_ids": prompt_block_ids,
                      "remote_num_tokens": request.num_prompt_tokens}


# ---------------------------------------------------------------------- worker half
class P2PWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        _check_single_rank()
        self.settings = P2PSettings.from_extra(ctx.extra, port_offset=ctx.data_parallel_rank)
        self._meta = P2PMeta()
        self._zmq = zmq.Context()
        self._sender = _Sender(ctx, self.settings, self._zmq, self.read_blocks) if ctx.config.is_producer else None
        self._receiver = _Receiver(ctx, self.settings, self._zmq) if ctx.config.is_consumer else None
        self._closed = False

    def bind_connector_metadata(self, metadata: bytes | None) -> None:
        self._meta = P2PMeta() if metadata is None else msgspec.msgpack.decode(metadata, type=P2PMeta)

    def start_load_kv(self) -> None:
        # Asynchronous only: what arrives is written in get_finished, after the step's forward.
        if self._meta.sends and self._sender is not None:
            self._sender.register(self._meta.sends)
        if self._meta.loads and self._receiver is not None:
            self._receiver.submit(self._meta.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending = self._sender.take_finished(self.counters) if self._sender is not None else set()
        recving = (self._receiver.take_finished(finished_req_ids, self.counters, self.write_blocks)
                   if self._receiver is not None else set())
        return sending, recving

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        stopped = [side.close() for side in (self._sender, self._receiver) if side is not None]
        if all(stopped):  # term() would wait forever for a socket a stuck thread still holds
            self._zmq.term()
        else:
            logger.warning("P2P: a transfer thread did not stop in time; leaving its sockets")


def _check_single_rank() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise ValueError("P2PConnector supports tensor_parallel_size 1 only (one server and one "
                         "block table per engine)")


def handshake_reply(layout: KVLayout, engine_id: str, hello: Hello) -> Reply:
    """A prefiller's answer to a peer's Hello: OK if their pools' blocks are interchangeable,
    else an error naming every field that differs."""
    mismatch = layout.mismatch(hello.layout)
    if mismatch is None:
        return Reply(seq=hello.seq, status=OK, engine_id=engine_id)
    message = (f"engine {engine_id} refuses engine {hello.engine_id}: KV layouts differ "
               f"({mismatch}; 'ours' is {engine_id}'s)")
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

    def __init__(self, ctx: ConnectorContext, settings: P2PSettings, zmq_ctx: zmq.Context,
                 read_blocks: Callable[[list[int]], torch.Tensor]) -> None:
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
                logger.warning("P2P: nobody pulled request %s's KV within abort_timeout_s=%gs; freeing "
                               "its blocks", req_id, self.settings.abort_timeout_s)
                self._finish(req_id, now)
            for req_id in [r for r, when in self._gone.items() if now - when > self.settings.abort_timeout_s]:
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
            return _error(message, f"this is engine {self.ctx.engine_id}, not {message.engine_id}"), None
        with self._lock:
            send = self._pending.get(message.request_id)
            if send is None:
                if message.request_id not in self._gone:
                    return Reply(seq=message.seq, status=NOT_READY), None  # its metadata is a step late
                if isinstance(message, Done):
                    return Reply(seq=message.seq, status=OK), None
                return _error(message, f"request {message.request_id}'s blocks are no longer held "
                                       f"(sent, or not pulled within abort_timeout_s)"), None
            if isinstance(message, Done):
                self._finish(message.request_id, time.monotonic())
                return Reply(seq=message.seq, status=OK), None
            return self._serve_pull(message, send)

    def _serve_pull(self, pull: Pull, send: _PendingSend) -> tuple[Reply, torch.Tensor | None]:
        # A decoder with a local prefix hit pulls the rest: the registered blocks' tail, in order
        # (out of order or repeated, they would land as wrong K/V at the decoder's positions).
        block_ids = send.spec.block_ids
        if not pull.block_ids or pull.block_ids != block_ids[len(block_ids) - len(pull.block_ids):]:
            return _error(pull, f"blocks {pull.block_ids[:64]} are not the tail of request "
                                f"{pull.request_id}'s prompt blocks"), None
        if pull.prompt_digest != send.spec.prompt_digest:
            return _error(pull, f"request {pull.request_id} prefilled another prompt than the puller's"), None
        started = time.perf_counter()
        kv = self._read_blocks(pull.block_ids).cpu().contiguous()  # [L, 2, n, block_size, Hkv, D]
        data = kv.reshape(-1).view(torch.uint8)  # bf16 and friends travel as bytes
        self._counters.timed_save(data.numel(), started)
        return Reply(seq=pull.seq, status=OK, dtype=str(kv.dtype).removeprefix("torch."),
                     shape=list(kv.shape), nbytes=data.numel()), data

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
        self._results: "queue.SimpleQueue[_Result]" = queue.SimpleQueue()
        self._pullers: dict[tuple[str, int], _Puller] = {}

    def submit(self, specs: list[LoadJob]) -> None:
        for spec in specs:
            job = _Job(spec)
            self._loading[spec.request_id] = job
            peer = (spec.remote_host, spec.remote_port)
            if peer not in self._pullers:
                self._pullers[peer] = _Puller(self.ctx, self.settings, self._zmq, *peer, self._results)
            self._pullers[peer].jobs.put(job)

    def take_finished(self, finished_req_ids: set[str], counters: TransferCounters,
                      write_blocks: Callable[[list[int], torch.Tensor], None]) -> set[str]:
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
            logger.exception("P2P: writing request %s's KV into the pool failed", result.job.spec.request_id)
            return False
        counters.timed_load(result.kv.numel() * result.kv.element_size(), result.job.started)
        return True

    def close(self) -> bool:
        return all([puller.close() for puller in self._pullers.values()])


class _Puller:
    """One thread and one connection per prefiller: handshake once, then its jobs in turn."""

    def __init__(self, ctx: ConnectorContext, settings: P2PSettings, zmq_ctx: zmq.Context,
                 host: str, port: int, results: "queue.SimpleQueue[_Result]") -> None:
        self.ctx = ctx
        self.settings = settings
        self.jobs: "queue.SimpleQueue[_Job | None]" = queue.SimpleQueue()
        self._results = results
        self._stop = threading.Event()
        self._client = PeerClient(zmq_ctx, host, port, self._stop)
        self._unanswered_at = float("-inf")  # when the peer last let a request time out
        self._thread = threading.Thread(target=self._run, name=f"p2p-pull-{host}:{port}", daemon=True)
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
            logger.error("P2P: loading request %s's KV from engine %s at %s failed (%s); it is "
                         "recomputed or fails per kv_load_failure_policy", job.spec.request_id,
                         job.spec.remote_engine_id, self._client.address, exc)
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
            reply, _ = self._call(Hello(seq=0, engine_id=self.ctx.engine_id, layout=self.ctx.layout.describe()),
                                  deadline)
            if reply.status != OK:
                raise _Refused(f"handshake refused: {reply.message}")
            self._client.greeted_engine_id = reply.engine_id
        pull = Pull(seq=0, engine_id=spec.remote_engine_id, request_id=spec.remote_request_id,
                    block_ids=spec.remote_block_ids, prompt_digest=spec.prompt_digest)
        expected = self._num_bytes(len(spec.local_block_ids))
        while not job.cancelled.is_set():
            reply, data = self._call(pull, deadline, expected)
            if reply.status == OK:
                return self._blocks(reply, data, len(spec.local_block_ids))
            if reply.status != NOT_READY:
                raise _Refused(reply.message)
            if time.monotonic() + NOT_READY_RETRY_S >= deadline:
                raise TransportError(f"request {spec.remote_request_id} not known there within pull_timeout_s")
            job.cancelled.wait(NOT_READY_RETRY_S)
        return None

    def _num_bytes(self, num_blocks: int) -> int:
        layout = self.ctx.layout
        itemsize = getattr(torch, layout.dtype).itemsize
        return layout.num_layers * 2 * num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize

    def _call(self, message: Message, deadline: float, max_reply_bytes: int = 0) -> tuple[Reply, torch.Tensor | None]:
        try:
            return self._client.call(message, deadline, max_reply_bytes)
        except TransportError as exc:
            raise _NoAnswer(str(exc)) from exc

    def _blocks(self, reply: Reply, data: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """The reply's bytes as K/V [L, 2, n, block_size, Hkv, D], checked against our layout."""
        layout = self.ctx.layout
        shape = [layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim]
        dtype = getattr(torch, layout.dtype)
        if reply.dtype != layout.dtype or reply.shape != shape:
            raise _Refused(f"got {reply.dtype} {reply.shape}, expected {layout.dtype} {shape}")
        if data.numel() != torch.Size(shape).numel() * dtype.itemsize:
            raise _Refused(f"got {data.numel()} bytes for {layout.dtype} {shape}")
        return data.view(dtype).view(shape)

    def _send_done(self, job: _Job) -> None:
        """Tell the prefiller it may free the blocks; if it cannot hear it, its timeout does."""
        deadline = time.monotonic() + self.settings.pull_timeout_s
        done = Done(seq=0, engine_id=job.spec.remote_engine_id, request_id=job.spec.remote_request_id)
        try:
            while (reply := self._client.call(done, deadline)[0]).status == NOT_READY:
                if time.monotonic() + NOT_READY_RETRY_S >= deadline:
                    raise TransportError("request not known there")
                time.sleep(NOT_READY_RETRY_S)
        except TransportError as exc:
            logger.warning("P2P: DONE for request %s to %s not delivered (%s); the prefiller frees it "
                           "after its abort_timeout_s", job.spec.remote_request_id, self._client.address, exc)
            return
        if reply.status != OK:
            logger.warning("P2P: DONE for request %s refused by %s: %s", job.spec.remote_request_id,
                           self._client.address, reply.message)

    def close(self) -> bool:
        self._stop.set()
        self.jobs.put(None)
        self._thread.join(timeout=5)
        return not self._thread.is_alive()


class _NoAnswer(TransportError):
    """The peer sent no (usable) reply in time."""


class _Refused(TransportError):
    """The peer answered, but not with the blocks (an error, a refused handshake, wrong shape)."""
