"""The proxy's HTTP app: routes, the upstream client's life cycle, run_proxy (L5).

    app = build_app(ProxyConfig(prefill_urls=(...), decode_urls=(...)))   # no module-level state
    lifespan: one httpx.AsyncClient for all upstream calls + the health probe task

Routes: POST /v1/completions and /v1/chat/completions (prefill, then decode), GET /v1/models
(from a decoder), GET /health (200 while a decoder is in rotation), GET /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenbus.api.proxy.config import ProxyConfig
from tokenbus.api.proxy.errors import ProxyError, error_response
from tokenbus.api.proxy.health import probe_forever
from tokenbus.api.proxy.metrics import ProxyMetrics
from tokenbus.api.proxy.pool import InstanceKind, InstancePool
from tokenbus.api.proxy.router import Router
from tokenbus.utils.net import bind_socket
from tokenbus.utils.tasks import cancel_all

logger = logging.getLogger("tokenbus.proxy")


@dataclass
class ProxyState:
    config: ProxyConfig
    prefill: InstancePool
    decode: InstancePool
    registry: CollectorRegistry
    metrics: ProxyMetrics
    router: Router | None = None  # made by the lifespan, with the client it owns
    tasks: list[asyncio.Task] = field(default_factory=list)

    def get_router(self) -> Router:
        if self.router is None:
            raise ProxyError(503, "The proxy is starting or stopping.")
        return self.router


def build_app(config: ProxyConfig, registry: CollectorRegistry | None = None) -> FastAPI:
    prefill = InstancePool(InstanceKind.PREFILL, config.prefill_urls)
    decode = InstancePool(InstanceKind.DECODE, config.decode_urls)
    registry = registry or CollectorRegistry()
    state = ProxyState(config, prefill, decode, registry, ProxyMetrics(registry, (prefill, decode)))
    app = FastAPI(title="tokenbus proxy", lifespan=_lifespan(state))
    app.state.proxy = state
    _install_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ProxyState) -> None:
    max_bytes = state.config.max_request_body_bytes

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw, body = await read_json_object(request, max_bytes)
        return await state.get_router().complete("/v1/completions", raw, body, request.headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw, body = await read_json_object(request, max_bytes)
        return await state.get_router().complete("/v1/chat/completions", raw, body, request.headers)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await state.get_router().forward_get("/v1/models", request.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not state.decode.healthy:
            return error_response(ProxyError(503, "No decode instance is available."))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


async def read_json_object(request: Request, max_bytes: int) -> tuple[bytes, dict]:
    """The body as received and as parsed; a 400 (413 when too large) before anything is
    sent upstream."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ProxyError(413, f"The request body is larger than {max_bytes} bytes.")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ProxyError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"The request body must be a JSON object, not {type(body).__name__}.")
    return raw, body


def _install_error_handlers(app: FastAPI) -> None:
    async def on_proxy_error(request: Request, exc: ProxyError) -> Response:
        if exc.status != 503:
            logger.info("%d %s %s: %s", exc.status, request.method, request.url.path, exc.message)
        return error_response(exc)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(ProxyError(exc.status_code, str(exc.detail), headers=exc.headers))

    app.add_exception_handler(ProxyError, on_proxy_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # 404, 405 in the same shape


def _lifespan(state: ProxyState):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        config = state.config
        # Each leg sets its own timeouts (router.Leg; the probes theirs): a prefill is bounded
        # by --prefill-timeout, a decode stream only by --decode-timeout between bytes, since it
        # may be quiet for as long as its request is queued. This default is a decode leg's.
        # No pool limits: concurrency is the clients' to choose (--request-timeout bounds a
        # request). A connect timeout: an instance that drops packets counts as dead, soon.
        # trust_env=False: instances are addressed directly, never through $HTTP_PROXY.
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.decode_timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
        )
        state.router = Router(client, state.prefill, state.decode, state.metrics, config)
        state.tasks.append(
            asyncio.create_task(
                probe_forever(
                    client,
                    (state.prefill, state.decode),
                    config.health_interval,
                    config.health_timeout,
                    # The engine probe is a prefill of a word: a prefill's patience.
                    config.prefill_timeout,
                ),
                name="proxy-health-probe",
            )
        )
        try:
            yield
        finally:
            await cancel_all(state.tasks)
            state.router = None
            await client.aclose()

    return lifespan


def run_proxy(config: ProxyConfig) -> int:
    """Serve until SIGINT/SIGTERM (open streams get --shutdown-timeout to finish)."""
    # httpx logs every request at INFO: each health probe, every few seconds, per instance.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = bind_socket(config.host, config.port)
    try:
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(config),
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=config.shutdown_timeout,
            )
        )
        host, port = sock.getsockname()[:2]
        logger.info(
            "Proxying on http://%s:%d: prefill %s, decode %s",
            host,
            port,
            list(config.prefill_urls) or "(none)",
            list(config.decode_urls),
        )
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    return 0
