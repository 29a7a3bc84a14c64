"""The P2PConnector's wire (L2): a ROUTER that serves a prefiller's blocks, a DEALER per peer
that pulls them. msgpack headers (msgspec, never pickle); block bytes as one raw frame, sent
without a copy and received straight into a tensor.

Every request carries a `seq` that its reply echoes, so a client that gave up on a request
(timeout) drops a late reply instead of taking it for the next one.

    client → server: [msgpack(Hello | Pull | Done)]
    server → client: [msgpack(Reply)] or, for a served Pull, [msgpack(Reply), block bytes]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

logger = logging.getLogger(__name__)

OK, NOT_READY, ERROR = "ok", "not_ready", "error"
POLL_MS = 100  # how often the server thread looks at its stop flag


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """The first message on a connection: who the client is and its pool's KVLayout."""

    seq: int
    engine_id: str
    layout: dict


class Pull(msgspec.Struct, tag="pull", kw_only=True):
    seq: int
    engine_id: str  # the server the client expects (a restarted engine has a new id)
    request_id: str  # the server's request id
    block_ids: list[int]  # the server's block ids
    prompt_digest: str  # p2p.prompt_digest of the client's prompt: it must be the server's


class Done(msgspec.Struct, tag="done", kw_only=True):
    """The client holds the blocks (or gave up on them): the server may free them."""

    seq: int
    engine_id: str
    request_id: str


Message = Hello | Pull | Done


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    seq: int
    status: str  # OK | NOT_READY | ERROR
    message: str = ""  # why, for ERROR
    engine_id: str = ""  # a Hello's: the server's engine id
    dtype: str = ""  # a served Pull: the blocks' torch dtype name and shape; bytes follow
    shape: list[int] = []
    nbytes: int = 0


class TransportError(Exception):
    """A request that got no usable answer (timeout, refused, malformed)."""


_message_decoder = msgspec.msgpack.Decoder(Message)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()

# A handler answers one message: its reply and, for a served Pull, the block bytes.
Handler = Callable[[Message], tuple[Reply, torch.Tensor | None]]


MAX_REQUEST_BYTES = 1 << 20


class BlockServer:
    """A ROUTER bound at host:port, served by one background thread calling `handler`."""

    def __init__(self, zmq_ctx: zmq.Context, host: str, port: int, handler: Handler) -> None:
        self.address = f"tcp://{host}:{port}"
        self._socket = zmq_ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Peers send small msgpack headers (block id lists): whoever reaches the port may not
        # make us buffer more (ZMQ drops the connection of a sender over the limit).
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(
                f"P2PConnector: cannot bind kv_host/kv_port {self.address}: {exc}"
            ) from exc
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="p2p-kv-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_MS):
                    self._answer(self._socket.recv_multipart())
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                logger.error("P2P KV server at %s stopped: %s", self.address, exc)
        finally:
            self._socket.close()

    def _answer(self, frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[-1]
        try:
            message = _message_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._socket.send_multipart(
                [
                    identity,
                    _encoder.encode(Reply(seq=-1, status=ERROR, message=f"bad message: {exc}")),
                ]
            )
            return
        try:
            reply, data = self._handler(message)
        except Exception as exc:  # a bug answering one peer must not stop the server
            logger.exception("P2P KV server: failed to answer %s", type(message).__name__)
            reply, data = Reply(seq=message.seq, status=ERROR, message=f"server error: {exc}"), None
        if data is None:
            self._socket.send_multipart([identity, _encoder.encode(reply)])
        else:
            # Zero copy: zmq keeps a reference to the array until the bytes are out.
            self._socket.send_multipart(
                [identity, _encoder.encode(reply), data.numpy()], copy=False
            )

    def close(self) -> bool:
        """Stop the thread (it closes the socket); False if it did not end in time."""
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)
        return not self._thread.is_alive()


class PeerClient:
    """One DEALER to one server; used by one thread only (zmq sockets are not thread-safe)."""

    def __init__(self, zmq_ctx: zmq.Context, host: str, port: int, stop: threading.Event) -> None:
        self.address = f"tcp://{host}:{port}"
        self._zmq_ctx = zmq_ctx
        self._stop = stop  # set: every call gives up at once (shutdown)
        self._seq = 0
        self._socket: zmq.Socket | None = None
        self.greeted_engine_id: str | None = (
            None  # whose server accepted our Hello on this connection
        )

    def call(
        self, message: Message, deadline: float, max_reply_bytes: int = 0
    ) -> tuple[Reply, torch.Tensor | None]:
        """Send `message` (its seq is set here), wait for its reply until `deadline`
        (time.monotonic()); a reply with bytes comes with them as a uint8 tensor. A reply that
        announces more than `max_reply_bytes` is dropped unread (nothing is allocated for it)."""
        self._seq += 1
        message.seq = self._seq
        try:
            socket = self._connect()
            socket.send(_encoder.encode(message), flags=zmq.NOBLOCK)
            while (remaining := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                if not socket.poll(max(1, min(POLL_MS, int(remaining * 1000)))):
                    continue
                reply, data = self._receive(socket, max_reply_bytes)
                if reply is not None and reply.seq == message.seq:
                    return reply, data
        except zmq.ZMQError as exc:  # a bad address, a full queue
            self.reset()
            raise TransportError(f"{self.address}: {exc}") from exc
        self.reset()  # a late reply must not meet the next request
        raise TransportError(
            "shutting down" if self._stop.is_set() else f"no reply from {self.address} in time"
        )

    def _receive(
        self, socket: zmq.Socket, max_bytes: int
    ) -> tuple[Reply | None, torch.Tensor | None]:
        try:
            reply = _reply_decoder.decode(socket.recv())
        except (msgspec.DecodeError, msgspec.ValidationError):
            reply = None
        if reply is not None and reply.nbytes > max_bytes:
            reply = None  # more than we asked for: not ours to buffer
        data = None
        while socket.getsockopt(zmq.RCVMORE):
            if reply is None or reply.nbytes <= 0 or data is not None:
                socket.recv()  # not for us (a stale or malformed reply): drop it
                continue
            data = torch.empty(reply.nbytes, dtype=torch.uint8)
            if socket.recv_into(data.numpy()) != reply.nbytes:
                reply = None  # truncated or oversized: not the bytes the header promised
        if reply is not None and reply.nbytes > 0 and data is None:
            reply = None
        return reply, data

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self._zmq_ctx.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.address)
        return self._socket

    def reset(self) -> None:
        """Drop the connection (and anything queued on it); the next call reconnects."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self.greeted_engine_id = None

    def close(self) -> None:
        self.reset()
