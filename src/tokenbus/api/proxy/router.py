"""One request through the proxy: the prefill leg, then the decode leg (L5).

    body ──► prefill instance: max_tokens=1, stream=false, n=1,
             kv_transfer_params={"do_remote_decode": true}
         ◄── its response's top-level kv_transfer_params (an object; null: it has no connector)
    body + kv_transfer_params ──► decode instance ──► relayed to the client byte for byte

Failures, by leg:
- an instance that cannot be reached or drops the connection (httpx.TransportError) is marked
  down (the health probe brings it back) and the leg is retried on another of its kind;
- an instance that takes a leg and does not answer it in time (--prefill-timeout for the whole
  prefill leg, --decode-timeout between a decode leg's bytes) is treated the same, except that
  it comes back only once its engine answers the probe (health.py): a stopped engine behind a
  live API process still passes /health;
- prefill: a 4xx is the client's error and is returned as is (the decoder would refuse the
  same body); a 5xx tries the next prefiller; with none left the decoder gets the body
  unchanged (less any kv_transfer_params of the client's) and computes the prompt itself;
- a request one prefill cannot serve (n > 1, several prompts) skips the prefill leg;
- decode: with no decoder left, 503 (without a prefill when none is known to be healthy).
  Whatever a decoder answers, errors included, is relayed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenbus.api.proxy.config import ProxyConfig
from tokenbus.api.proxy.errors import ProxyError, error_body
from tokenbus.api.proxy.metrics import ProxyMetrics
from tokenbus.api.proxy.pool import EngineCheck, Instance, InstancePool

logger = logging.getLogger("tokenbus.proxy")

# Fields a one-token prefill must not carry: they would make it generate more than it needs
# (best_of, max_completion_tokens), or contradict max_tokens=1 and be refused (min_tokens).
_NOT_FOR_PREFILL = ("max_completion_tokens", "stream_options", "min_tokens", "best_of")
_FORWARDED_REQUEST_HEADERS = ("authorization",)
_RELAYED_RESPONSE_HEADERS = frozenset(
    {"content-type", "cache-control", "x-accel-buffering", "retry-after", "x-request-id"}
)


def prefill_body(body: dict) -> dict:
    """The prefill leg's body: the client's, cut to computing the prompt and one token."""
    prefill = {name: value for name, value in body.items() if name not in _NOT_FOR_PREFILL}
    prefill.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    return prefill


def one_prefill_serves(body: dict) -> bool:
    """Whether one prefill leg can serve the request: a server hands KV over for one prompt
    and one sequence only. Others (n > 1, best_of > 1, several prompts) go to a decoder whole,
    which computes their prompts itself."""
    if body.get("n", 1) not in (None, 1) or body.get("best_of", 1) not in (None, 1):
        return False
    prompt = body.get("prompt")
    # A list prompt is one prompt of token ids, or several prompts (texts or token-id lists).
    return not (isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int))


def upstream_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        # aiter_raw relays bytes as they come: keep the instances from compressing them.
        "accept-encoding": "identity",
        # One id on both legs, so the two instances' logs of a request can be matched.
        "x-request-id": client_headers.get("x-request-id") or uuid.uuid4().hex,
    }
    for name in _FORWARDED_REQUEST_HEADERS:
        if name in client_headers:
            headers[name] = client_headers[name]
    return headers


@dataclass(frozen=True)
class Deadline:
    at: float | None  # time.monotonic() by which the request's last byte must be out; None: never

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds)

    def scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A scope that raises TimeoutError when the time left runs out (anyio's clock is the
        event loop's, which is time.monotonic())."""
        return anyio.fail_after(None if self.at is None else max(0.0, self.at - time.monotonic()))


class InstanceDown(Exception):
    """An instance could not be reached, dropped the connection or did not answer in time; it
    is marked down."""


@dataclass(frozen=True)
class Leg:
    """How one leg waits for an instance, and what its silence means."""

    # connect: an unreachable instance is dead; read and write: between bytes
    timeout: httpx.Timeout
    # Seconds from sending to the whole answer (the headers, for a stream); None: unbounded
    # (but for the request's deadline).
    total_s: float | None = None
    # A timeout other than connect's marks the instance down until its engine answers this
    # probe; None: until /health answers 200 (a leg that needs no engine).
    engine_check: EngineCheck | None = None


class Router:
    def __init__(
        self,
        client: httpx.AsyncClient,
        prefill: InstancePool,
        decode: InstancePool,
        metrics: ProxyMetrics,
        config: ProxyConfig,
    ) -> None:
        self.client = client
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.config = config
        self._is_falling_back = False  # warned that decoders compute prompts; reset by a prefill
        self._warned_no_params: set[str] = set()  # prefill URLs that answered null params

    async def complete(
        self, path: str, raw_body: bytes, body: dict, client_headers: Mapping[str, str]
    ) -> Response:
        """POST `path` (/v1/completions, /v1/chat/completions): prefill, then decode."""
        if not self.decode.healthy:  # before prefilling: its KV would wait for nobody
            raise self._no_instance_error(self.decode)
        deadline = Deadline.after(self.config.request_timeout)
        headers = upstream_headers(client_headers)
        check = EngineCheck(body.get("model"), headers.get("authorization"))
        outcome = (
            await self._prefill(path, body, headers, deadline, check)
            if one_prefill_serves(body)
            else None
        )
        if isinstance(outcome, Response):
            return outcome
        if outcome is None and "kv_transfer_params" not in body:
            content = raw_body  # the decoder computes the prompt: the client's bytes as they came
        elif outcome is None:
            # The proxy owns kv_transfer_params: a client's own (any host, port and blocks) must
            # not reach the decoder's KV connector.
            content = json.dumps(
                {k: v for k, v in body.items() if k != "kv_transfer_params"}
            ).encode()
        else:
            content = json.dumps({**body, "kv_transfer_params": outcome}).encode()
        leg = Leg(self._decode_timeout(), engine_check=check)
        answer = await self._first_answer(
            self.decode, "POST", path, content, headers, deadline, leg, stream=True
        )
        if answer is None:
            raise self._no_instance_error(self.decode)
        instance, upstream = answer
        return RelayResponse(
            upstream,
            self._relay(instance, upstream, deadline, leg),
            on_close=functools.partial(self.decode.release, instance),
        )

    async def forward_get(self, path: str, client_headers: Mapping[str, str]) -> Response:
        """GET `path` (/v1/models) from a decoder."""
        deadline = Deadline.after(self.config.request_timeout)
        # The API process answers it without the engine, at once: a prefill's patience is
        # plenty, and a timeout there needs no engine check (/health shares that process).
        leg = Leg(httpx.Timeout(self.config.prefill_timeout, connect=self.config.connect_timeout))
        answer = await self._first_answer(
            self.decode, "GET", path, None, upstream_headers(client_headers), deadline, leg
        )
        if answer is None:
            raise self._no_instance_error(self.decode)
        instance, upstream = answer
        self.decode.release(instance)
        return relay_whole(upstream)

    async def _prefill(
        self,
        path: str,
        body: dict,
        headers: dict[str, str],
        deadline: Deadline,
        check: EngineCheck,
    ) -> dict | Response | None:
        """The prefiller's kv_transfer_params; its answer when it refused the request (4xx);
        None when the decoder is to compute the prompt itself."""
        content = json.dumps(prefill_body(body)).encode()
        timeout_s = self.config.prefill_timeout
        # A total bound, not only one between bytes: the answer is one piece, sent when the
        # prompt is computed, and a prefiller that trickles bytes must not hold the request.
        leg = Leg(httpx.Timeout(timeout_s, connect=self.config.connect_timeout), timeout_s, check)
        answer = await self._first_answer(
            self.prefill,
            "POST",
            path,
            content,
            headers,
            deadline,
            leg,
            is_answer=lambda r: r.status_code < 500,
        )
        if answer is None:
            self._fall_back()
            return None
        instance, response = answer
        self.prefill.release(instance)
        if not response.is_success:
            return relay_whole(response)
        if self._is_falling_back:
            logger.info("prefill instances serve again: prompts are prefilled remotely again")
            self._is_falling_back = False
        return self._kv_transfer_params(instance, response)

    async def _first_answer(
        self,
        pool: InstancePool,
        method: str,
        path: str,
        content: bytes | None,
        headers: dict[str, str],
        deadline: Deadline,
        leg: Leg,
        stream: bool = False,
        is_answer: Callable[[httpx.Response], bool] = lambda r: True,
    ) -> tuple[Instance, httpx.Response] | None:
        """Send to the least-loaded healthy instance of `pool`, then to the next, until one
        gives an answer; None when none did. The answering instance is left acquired."""
        tried: list[Instance] = []
        while (instance := pool.acquire(exclude=tried)) is not None:
            tried.append(instance)
            try:
                response = await self._send(
                    pool, instance, method, path, content, headers, deadline, leg, stream
                )
            except InstanceDown:
                pool.release(instance)
                continue
            except BaseException:
                pool.release(instance)
                raise
            if is_answer(response):
                return instance, response
            pool.release(instance)
            await response.aclose()
            self.metrics.failure(instance)
            logger.warning(
                "%s instance %s answered %s %s with %d; trying another",
                pool.kind.value,
                instance.url,
                method,
                path,
                response.status_code,
            )
        return None

    async def _send(
        self,
        pool: InstancePool,
        instance: Instance,
        method: str,
        path: str,
        content: bytes | None,
        headers: dict[str, str],
        deadline: Deadline,
        leg: Leg,
        stream: bool,
    ) -> httpx.Response:
        """One try; with stream=True it returns once the headers are in."""
        self.metrics.request(instance)
        request = self.client.build_request(
            method, instance.url + path, content=content, headers=headers, timeout=leg.timeout
        )
        try:
            with deadline.scope():  # the request's deadline: TimeoutError, a 408
                # The leg's own bound, inside: when it runs out first, the scope ends quietly
                # and the instance is the one to blame, not the request.
                with anyio.move_on_after(leg.total_s):
                    return await self.client.send(request, stream=stream)
        except httpx.ConnectTimeout as exc:  # before the timeouts below: it is one of them
            self._instance_failed(pool, instance, f"{method} {path}", exc)
        except httpx.TimeoutException as exc:  # read, write: it took the request, then went quiet
            self._instance_failed(pool, instance, f"{method} {path}", exc, leg.engine_check)
        except httpx.TransportError as exc:
            self._instance_failed(pool, instance, f"{method} {path}", exc)
        except TimeoutError:
            raise self._timeout_error() from None
        self._instance_failed(
            pool,
            instance,
            f"{method} {path}",
            f"no answer in {leg.total_s:g} s",
            leg.engine_check,
        )

    def _instance_failed(
        self,
        pool: InstancePool,
        instance: Instance,
        what: str,
        why: Exception | str,
        engine_check: EngineCheck | None = None,
    ) -> NoReturn:
        self.metrics.failure(instance)
        if isinstance(why, Exception):
            why = f"{type(why).__name__}: {why}" if str(why) else type(why).__name__
        pool.mark_down(instance, f"{what}: {why}", engine_check)
        raise InstanceDown(instance.url)

    async def _relay(
        self, instance: Instance, upstream: httpx.Response, deadline: Deadline, leg: Leg
    ) -> AsyncIterator[bytes]:
        """The decoder's body as it arrives. Past the headers a failure can no longer change
        the status: a stream ends with an error event (as the server's own streams do), any
        other body is cut short (the client sees an incomplete response, not a wrong one)."""
        chunks = upstream.aiter_raw()
        ends_event = True  # whether the bytes so far end on an SSE event boundary
        try:
            while True:
                with deadline.scope():
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return
                ends_event = chunk.endswith(b"\n\n")
                yield chunk
        except httpx.TimeoutException as exc:  # silent for --decode-timeout mid-answer
            self.metrics.failure(instance)
            self.decode.mark_down(
                instance, f"went silent mid-body: {type(exc).__name__}", leg.engine_check
            )
            error = ProxyError(
                504,
                f"The decode instance sent nothing for the proxy's --decode-timeout "
                f"({self.config.decode_timeout:g} s).",
            )
        except httpx.TransportError as exc:
            self.metrics.failure(instance)
            self.decode.mark_down(
                instance, f"dropped a response mid-body: {type(exc).__name__}: {exc}"
            )
            error = ProxyError(502, "The decode instance failed while answering.")
        except TimeoutError:
            error = self._timeout_error()
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            raise BodyCut(error.message)
        # After a partial event, a blank line ends it, so the error event parses on its own.
        event = json.dumps(error_body(error.status, error.message, error.param))
        yield (b"" if ends_event else b"\n\n") + f"data: {event}\n\ndata: [DONE]\n\n".encode()

    def _fall_back(self) -> None:
        self.metrics.fallback()
        if not self._is_falling_back:
            down = "; ".join(
                f"{i.url}: {i.down_reason or 'failed'}" for i in self.prefill.instances
            )
            logger.warning(
                "no prefill instance can serve requests (%s): decode instances compute "
                "prompts themselves until one is back",
                down or "none configured",
            )
            self._is_falling_back = True

    def _kv_transfer_params(self, instance: Instance, response: httpx.Response) -> dict | None:
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):  # not JSON, or not an object
            params = "(the body is not a JSON object)"
        if isinstance(params, dict):
            return params
        if instance.url not in self._warned_no_params:
            self._warned_no_params.add(instance.url)
            logger.warning(
                "prefill instance %s answered kv_transfer_params %s, not an object "
                "(no KV connector?): decoders compute its requests' prompts themselves",
                instance.url,
                json.dumps(params)[:200],
            )
        return None

    def _decode_timeout(self) -> httpx.Timeout:
        # write too: a decoder that stopped reading a large body is as stuck as a silent one.
        return httpx.Timeout(self.config.decode_timeout, connect=self.config.connect_timeout)

    def _no_instance_error(self, pool: InstancePool) -> ProxyError:
        # Upstream addresses stay in the log (mark_down wrote why): clients don't need them.
        retry_after = str(math.ceil(self.config.health_interval))
        return ProxyError(
            503,
            f"No {pool.kind.value} instance is available; try again later.",
            headers={"Retry-After": retry_after},
        )

    def _timeout_error(self) -> ProxyError:
        return ProxyError(
            408,
            f"The request took longer than the proxy's --request-timeout "
            f"({self.config.request_timeout:g} s).",
        )


class BodyCut(Exception):
    """A non-stream body failed midway: it ends the response unfinished, so the client's
    connection is dropped rather than a truncated body ended as if it were whole."""


def relay_whole(upstream: httpx.Response) -> Response:
    """A read upstream response, status and body unchanged."""
    return Response(
        upstream.content, status_code=upstream.status_code, headers=_relayed_headers(upstream)
    )


def _relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    return {
        name: value
        for name, value in upstream.headers.items()
        if name.lower() in _RELAYED_RESPONSE_HEADERS
    }


class RelayResponse(StreamingResponse):
    """An upstream response relayed as it arrives. However it ends (done, client gone, error),
    the upstream response is closed, so the instance sees the disconnect and aborts the
    request, and the instance is released."""

    def __init__(
        self, upstream: httpx.Response, body: AsyncIterator[bytes], on_close: Callable[[], None]
    ) -> None:
        super().__init__(body, status_code=upstream.status_code, headers=_relayed_headers(upstream))
        self._upstream = upstream
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BodyCut:
            pass  # logged by mark_down; uvicorn drops the connection of an incomplete response
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._upstream.aclose()
            self._on_close()
