"""P2PConnector (L2): a decoder pulls a prefiller's prompt KV over the network (vLLM's
NIXL-style pull flow, our code). This module holds the two halves; p2p_config.py the settings
and the scheduler → worker metadata; p2p_peers.py the transfer threads; p2p_transport.py the
ZMQ/TCP messages.

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

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq

from tokenbus.core.request import RequestStatus
from tokenbus.kv_transfer.base import ConnectorContext, KVConnectorWorker
from tokenbus.kv_transfer.p2p_config import LoadJob, P2PMeta, P2PSettings, SendSpec, prompt_digest
from tokenbus.kv_transfer.p2p_peers import _Receiver, _Sender
from tokenbus.utils import cdiv

if TYPE_CHECKING:
    from tokenbus.core.outputs import KVConnectorOutput
    from tokenbus.core.request import Request
    from tokenbus.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

_SENT_NORMALLY = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


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
    def parse(cls, params: dict | None) -> RemotePrefill | None:
        """None if the params do not ask for a remote prefill; ValueError if they do, badly."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        fields = {
            "remote_engine_id": str,
            "remote_host": str,
            "remote_port": int,
            "remote_request_id": str,
            "remote_block_ids": list,
            "remote_num_tokens": int,
        }
        for key, kind in fields.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{key} is missing or not a {kind.__name__}")
        if not 0 < params["remote_port"] < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        block_ids = params["remote_block_ids"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids")
        return cls(
            params["remote_engine_id"],
            params["remote_host"],
            params["remote_port"],
            params["remote_request_id"],
            list(block_ids),
            params["remote_num_tokens"],
        )


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
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.ctx.config.is_consumer or request.request_id in self._load_started:
            return 0, False
        remote = self._remote_prefill(request)
        if remote is None or num_computed_tokens >= request.num_prompt_tokens:
            return 0, False
        # The whole prompt: the scheduler computes its last token again for the logits.
        return request.num_prompt_tokens - num_computed_tokens, True

    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        try:
            remote = RemotePrefill.parse(request.kv_transfer_params)
        except ValueError as exc:
            self._warn_once(request, f"{exc}; computing the prompt locally")
            return None
        if remote is not None and not self.settings.allows_peer(remote.host):
            self._warn_once(
                request,
                f"remote_host {remote.host!r} is not in kv_peer_hosts "
                f"{list(self.settings.peer_hosts)}; computing the prompt locally",
            )
            return None
        if remote is not None and remote.num_tokens != request.num_prompt_tokens:
            self._warn_once(
                request,
                f"the prefiller computed {remote.num_tokens} tokens but the prompt has "
                f"{request.num_prompt_tokens}; computing it locally",
            )
            return None
        return remote

    def _warn_once(self, request: Request, message: str) -> None:
        if request.request_id not in self._warned:  # asked again each step while it waits
            self._warned.add(request.request_id)
            logger.warning("request %s: %s", request.request_id, message)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._remote_prefill(request)
        if num_external_tokens == 0 or remote is None:
            return
        # The local prefix hit is whole blocks; the load fills the rest of the prompt's blocks.
        first = request.num_computed_tokens // self.block_size
        end = cdiv(request.num_prompt_tokens, self.block_size)
        self._new_loads.append(
            LoadJob(
                request_id=request.request_id,
                local_block_ids=block_ids[first:end],
                remote_engine_id=remote.engine_id,
                remote_host=remote.host,
                remote_port=remote.port,
                remote_request_id=remote.request_id,
                remote_block_ids=remote.block_ids[first:end],
                prompt_digest=prompt_digest(request.prompt_token_ids),
            )
        )
        self._load_started.add(request.request_id)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes | None:
        if not self._new_loads and not self._new_sends:
            return None
        meta = P2PMeta(loads=self._new_loads, sends=self._new_sends)
        self._new_loads, self._new_sends = [], {}
        return msgspec.msgpack.encode(meta)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass  # the scheduler frees what the worker reports sent; nothing else to track

    def tier_occupancy(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ producer
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._load_started.discard(request.request_id)
        self._warned.discard(request.request_id)
        params = request.kv_transfer_params
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        if (
            not self.ctx.config.is_producer
            or not isinstance(params, dict)
            or not params.get("do_remote_decode")
            or request.status not in _SENT_NORMALLY
            # Stopped by the front end after a preemption: the prompt's KV is gone.
            or request.num_computed_tokens < request.num_prompt_tokens
            or len(block_ids) < num_blocks
        ):
            return False, None
        prompt_block_ids = list(block_ids[:num_blocks])
        self._new_sends[request.request_id] = SendSpec(
            prompt_block_ids, prompt_digest(request.prompt_token_ids)
        )
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.ctx.engine_id,
            "remote_host": self.settings.advertise_host,
            "remote_port": self.settings.port,
            "remote_request_id": request.request_id,
            "remote_block_ids": prompt_block_ids,
            "remote_num_tokens": request.num_prompt_tokens,
        }


# ---------------------------------------------------------------------- worker half
class P2PWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        _check_single_rank()
        self.settings = P2PSettings.from_extra(ctx.extra, port_offset=ctx.data_parallel_rank)
        self._meta = P2PMeta()
        self._zmq = zmq.Context()
        self._sender = (
            _Sender(ctx, self.settings, self._zmq, self.read_blocks)
            if ctx.config.is_producer
            else None
        )
        self._receiver = (
            _Receiver(ctx, self.settings, self._zmq) if ctx.config.is_consumer else None
        )
        self._closed = False

    def bind_connector_metadata(self, metadata: bytes | None) -> None:
        self._meta = (
            P2PMeta() if metadata is None else msgspec.msgpack.decode(metadata, type=P2PMeta)
        )

    def start_load_kv(self) -> None:
        # Asynchronous only: what arrives is written in get_finished, after the step's forward.
        if self._meta.sends and self._sender is not None:
            self._sender.register(self._meta.sends)
        if self._meta.loads and self._receiver is not None:
            self._receiver.submit(self._meta.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending = self._sender.take_finished(self.counters) if self._sender is not None else set()
        recving = (
            self._receiver.take_finished(finished_req_ids, self.counters, self.write_blocks)
            if self._receiver is not None
            else set()
        )
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
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        raise ValueError(
            "P2PConnector supports tensor_parallel_size 1 only (one server and one "
            "block table per engine)"
        )
