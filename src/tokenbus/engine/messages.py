"""The wire between a front end and its EngineCore process (L4).

Every message is two ZMQ frames: one byte naming its type, then a msgpack payload encoded by
msgspec with a typed decoder per type. Nothing is ever pickled: a peer can only make us build
the plain values these types allow.

    front end → engine (ROUTER → DEALER): ADD EngineRequest | ABORT [ids] | UTILITY | SHUTDOWN
    engine → front end, start-up (DEALER → ROUTER): READY | STARTUP_FAILED
    engine → front end, afterwards (PUSH → PULL): OUTPUTS | UTILITY_RESULT | ENGINE_DEAD |
                                                 HEARTBEAT (a second without anything else)
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tokenbus.protocol import EngineOutputs, EngineRequest


class RequestType(enum.IntEnum):
    """Front end → EngineCore."""

    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3
    # Never on the wire: the executor's failure callback puts it on the engine's own input
    # queue when a worker dies, so the busy loop raises even while idle.
    EXECUTOR_FAILED = 4


class MessageType(enum.IntEnum):
    """EngineCore → front end."""

    READY = 0
    STARTUP_FAILED = 1
    OUTPUTS = 2
    UTILITY_RESULT = 3
    ENGINE_DEAD = 4
    # Sent by the busy loop when it has sent nothing else for a while: the front end's proof
    # that the loop still turns (a stopped or hung engine goes silent; see AsyncLLM).
    HEARTBEAT = 5


class UtilityCall(msgspec.Struct, array_like=True):
    """Run a public EngineCore method by name; the reply carries the same call_id."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None  # a msgpack-able value (Structs arrive as plain lists/dicts)
    error_type: str | None = None  # the exception's class name when the call raised
    error: str | None = None


class ReadyInfo(msgspec.Struct, array_like=True):
    """Sent once the EngineCore is built: what the front end could not know before."""

    num_kv_blocks: int
    max_model_len: int
    pid: int


class EngineFailure(msgspec.Struct, array_like=True, omit_defaults=True):
    """Why the engine could not start (STARTUP_FAILED) or had to stop (ENGINE_DEAD)."""

    error_type: str
    message: str
    traceback: str = ""


class Empty(msgspec.Struct, array_like=True):
    """The payload of SHUTDOWN and HEARTBEAT."""


_REQUEST_TYPES: dict[RequestType, Any] = {
    RequestType.ADD: EngineRequest,
    RequestType.ABORT: list[str],
    RequestType.UTILITY: UtilityCall,
    RequestType.SHUTDOWN: Empty,
}
_MESSAGE_TYPES: dict[MessageType, Any] = {
    MessageType.READY: ReadyInfo,
    MessageType.STARTUP_FAILED: EngineFailure,
    MessageType.OUTPUTS: EngineOutputs,
    MessageType.UTILITY_RESULT: UtilityResult,
    MessageType.ENGINE_DEAD: EngineFailure,
    MessageType.HEARTBEAT: Empty,
}


class Codec:
    """Encoders and typed decoders for both directions. One per thread: msgspec's encoders
    reuse an internal buffer and must not be shared across threads."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoders = {
            t: msgspec.msgpack.Decoder(cls) for t, cls in _REQUEST_TYPES.items()
        }
        self._message_decoders = {
            t: msgspec.msgpack.Decoder(cls) for t, cls in _MESSAGE_TYPES.items()
        }

    def encode(self, kind: RequestType | MessageType, payload: Any) -> list[bytes]:
        return [bytes((int(kind),)), self._encoder.encode(payload)]

    def decode_request(self, frames: list[bytes]) -> tuple[RequestType, Any]:
        kind = RequestType(_type_byte(frames))
        return kind, self._request_decoders[kind].decode(frames[1])

    def decode_message(self, frames: list[bytes]) -> tuple[MessageType, Any]:
        kind = MessageType(_type_byte(frames))
        return kind, self._message_decoders[kind].decode(frames[1])


def _type_byte(frames: list[bytes]) -> int:
    if len(frames) != 2 or len(frames[0]) != 1:
        raise ValueError(f"malformed engine message: {len(frames)} frames")
    return frames[0][0]


# Exception types a utility error is raised as on the caller's side (anything else: RuntimeError).
_UTILITY_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ValueError, TypeError, KeyError, AssertionError, RuntimeError, NotImplementedError)
}


def utility_error(result: UtilityResult) -> Exception:
    """Rebuild the exception a utility call raised in the engine, from its name and text."""
    cls = _UTILITY_ERRORS.get(result.error_type or "")
    if cls is None:
        return RuntimeError(f"{result.error_type}: {result.error}")
    return cls(result.error)
