"""ASGI middleware: API-key check, request-body size limit, the last word on a bug (L5).

Plain ASGI (not BaseHTTPMiddleware) so that streaming responses and disconnects pass through
untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import posixpath
import re
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenbus.api.openai.errors import error_bytes, speaks_anthropic
from tokenbus.utils.log import log_safe

logger = logging.getLogger(__name__)

# Paths open without a key; everything else needs one (deny by default, unlike vLLM's /v1 prefix
# check, which new routes and path tricks like `//v1` kept bypassing).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/load"})
_SLASHES = re.compile(r"/+")
DRAIN_FACTOR = 8


def normalize_path(path: str) -> str:
    return posixpath.normpath(_SLASHES.sub("/", path or "/"))


class InternalErrorMiddleware:
    """A bug (any exception no handler answered) becomes a 500 in OpenAI's shape that closes
    its own connection; it is logged once, with its traceback, and never reaches uvicorn (which
    would log it again). Innermost of ours: the other middleware never raise."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception(
                "internal error serving %s %s",
                scope.get("method"),
                log_safe(scope.get("path", ""), 100),
                exc_info=exc,
            )
            if not started:  # else uvicorn ends the half-sent response by closing the connection
                await send_error(
                    send,
                    500,
                    f"Internal server error: {type(exc).__name__}",
                    "InternalServerError",
                    [(b"connection", b"close")],
                    path=scope.get("path", ""),
                )


async def send_error(
    send: Send,
    status: int,
    message: str,
    type_: str,
    extra_headers: list[tuple[bytes, bytes]] = (),
    path: str = "",
) -> None:
    """An error answer before any route ran, in the shape of the route `path` asked for."""
    body = error_bytes(status, message, type_, anthropic=speaks_anthropic(normalize_path(path)))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        # Compare digests: equal length, so compare_digest's time does not leak the key length.
        self._key_digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or normalize_path(scope["path"]) in PUBLIC_PATHS
        ):
            await self.app(scope, receive, send)
            return
        if self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(
            send,
            401,
            "Invalid or missing API key "
            "(send 'Authorization: Bearer <key>' or 'x-api-key: <key>').",
            "AuthenticationError",
            [(b"www-authenticate", b"Bearer")],
            path=scope["path"],
        )

    def _is_authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" and b"x-api-key" in headers:  # Anthropic clients' header
            scheme, token = "bearer", headers[b"x-api-key"].decode("latin-1")
        if scheme.lower() != "bearer":
            # A browser opening the /xray page cannot send a header: it may carry the key as
            # ?api_key=, and the page sends it on as a header for its stream.
            token = _xray_query_key(scope)
            if token is None:
                return False
        try:
            digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        except UnicodeEncodeError:  # a percent-decoded ?api_key= beyond latin-1: not the key
            return False
        return hmac.compare_digest(digest, self._key_digest)


def _xray_query_key(scope: Scope) -> str | None:
    if not normalize_path(scope["path"]).startswith("/xray"):
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    keys = query.get("api_key")
    return keys[0] if keys else None


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`, whether sized by Content-Length or sent chunked.

    The body is read here (at most `max_bytes` of it) and replayed to the app, so an oversized
    upload is refused before any of it is parsed.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            drain = int(declared) <= DRAIN_FACTOR * self.max_bytes
            await self._refuse(scope, receive, send, size=0, more_body=drain)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                more_body = message.get("more_body", False)
                await self._refuse(scope, receive, send, size, more_body=more_body)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, size: int, more_body: bool = True
    ) -> None:
        # Most clients send the whole body before they read a response; closing on them mid-upload
        # turns the 413 into a connection error. So a moderately oversized body is read (and
        # dropped) first; beyond DRAIN_FACTOR × the limit the connection is simply closed.
        while more_body and size <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            more_body = message.get("more_body", False)
        await send_error(
            send,
            413,
            f"Request body too large (limit {self.max_bytes} bytes).",
            "RequestTooLargeError",
            [(b"connection", b"close")],
            path=scope["path"],
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # afterwards: wait for http.disconnect as usual

    return replay
