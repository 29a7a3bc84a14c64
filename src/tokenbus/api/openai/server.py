"""The OpenAI-compatible HTTP server: app factory, background tasks, process life cycle (L5).

    launch.serve: bind the port, start the engine (this module imported meanwhile), then run_server:
    engine = AsyncLLM(setup, tokenizer, client, stat_loggers=[...])   # the engine is up
    app = build_app(ServerState(...))                                 # no module-level state
    uvicorn serves app; SIGTERM → stop accepting, drain up to --shutdown-timeout, engine.shutdown()

When the engine dies, in-flight requests end with an error, /health answers 503 for a short
while (so a load balancer sees it), and the process exits with status 1. When it stalls (work
pending, no step completed for --engine-stall-timeout seconds: stopped, or hung in a step),
/health answers 503 and new requests are refused until it steps again; its stacks are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import tokenbus
from tokenbus.api.openai import protocol as p
from tokenbus.api.openai.errors import (
    ServiceUnavailableError,
    error_response,
    install_error_handlers,
)
from tokenbus.api.openai.metrics import LoggingStatLogger, PrometheusStatLogger
from tokenbus.api.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    InternalErrorMiddleware,
)
from tokenbus.api.openai.reasoning_parsers import ReasoningParser, make_reasoning_parser
from tokenbus.api.openai.request_params import ParamLimits
from tokenbus.api.openai.sagemaker import add_sagemaker_routes
from tokenbus.api.openai.server_config import ServerConfig
from tokenbus.api.openai.serving_chat import ChatServing
from tokenbus.api.openai.serving_completions import CompletionServing
from tokenbus.api.openai.serving_embeddings import EmbeddingServing
from tokenbus.api.openai.serving_engine import Admission, ServingContext
from tokenbus.api.openai.serving_lora import LoRAModules, add_lora_routes
from tokenbus.api.openai.serving_messages import MessagesServing, add_messages_routes
from tokenbus.api.openai.serving_responses import ResponsesRequest, ResponsesServing
from tokenbus.api.openai.serving_tokenize import TokenizeServing
from tokenbus.api.openai.tool_parsers import PARSERS, ToolCallParser, make_parser
from tokenbus.api.openai.unsupported import UNSUPPORTED_FIELDS
from tokenbus.utils.tasks import cancel_all

if TYPE_CHECKING:
    from tokenbus.engine.core_client import EngineCoreClient
    from tokenbus.engine.setup import EngineSetup

logger = logging.getLogger("tokenbus.server")

DEFAULT_MODEL_NAME = "smollm2"
WATCHDOG_INTERVAL_S = 0.2
DEAD_INFLIGHT_WAIT_S = 5.0  # time in-flight requests get to deliver their error after engine death
# Without --max-waiting-requests: sequences that may wait, per sequence the engine runs at once.
DEFAULT_WAITING_PER_RUNNING = 1


@dataclass
class ServerState:
    config: ServerConfig
    ctx: ServingContext
    registry: CollectorRegistry
    log_stats: LoggingStatLogger | None = None
    exit_code: int = 0
    # Set by run_server: stops uvicorn. Tests that use the app alone leave it as a no-op.
    request_exit: Callable[[int], None] = lambda code: None
    tasks: list[asyncio.Task] = field(default_factory=list)


def known_params() -> frozenset[str]:
    """Field names an error may name as its `param` (refused ones included)."""
    names: set[str] = {"prompt_token_ids", *UNSUPPORTED_FIELDS}
    for model in (
        p.CompletionRequest,
        p.ChatCompletionRequest,
        p.TokenizeRequest,
        p.DetokenizeRequest,
        ResponsesRequest,
        p.EmbeddingRequest,
    ):
        names |= set(model.model_fields)
    return frozenset(names)


def make_serving_context(
    engine: Any, config: ServerConfig, served_model_names: list[str]
) -> ServingContext:
    defaults = engine.setup.sampling_defaults
    if defaults:
        logger.info(
            "sampling defaults for fields a request leaves out (--generation-config): %s", defaults
        )
    scheduler = engine.config.scheduler
    admission = Admission(
        scheduler.max_num_seqs, max_waiting(scheduler.max_num_seqs, scheduler.max_waiting_requests)
    )
    # Retry-After reads the engine's throughput from the same reports the metrics do.
    stat_loggers = getattr(engine, "stat_loggers", None)
    if stat_loggers is not None:
        stat_loggers.append(admission)
    return ServingContext(
        engine=engine,
        served_model_names=served_model_names,
        limits=ParamLimits(engine.input_processor.max_model_len, config.limits, defaults),
        admission=admission,
        known_params=known_params(),
        request_timeout_s=config.request_timeout,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        tool_parser=_tool_parser(config),
        reasoning_parser=_reasoning_parser(engine, config),
        loras=_lora_modules(engine, config, served_model_names),
    )


def _lora_modules(engine: Any, config: ServerConfig, base_names: list[str]) -> LoRAModules | None:
    """The adapters to serve, each checked against the model now: a bad one stops the start."""
    if not (config.lora_modules or config.enable_lora_runtime_updates):
        return None
    if engine.config.lora is None:
        flag = "lora_modules" if config.lora_modules else "enable_lora_runtime_updates"
        raise ValueError(f"{flag}: LoRA adapters need --enable-lora")
    loras = LoRAModules(engine, base_names)
    for lora in config.lora_modules:
        loras.add(lora)
    return loras


def _tool_parser(config: ServerConfig) -> ToolCallParser | None:
    if not config.enable_auto_tool_choice:
        return None
    if config.tool_call_parser is None:
        raise ValueError(
            f"enable_auto_tool_choice: needs --tool-call-parser ({', '.join(sorted(PARSERS))})"
        )
    return make_parser(config.tool_call_parser)


def _reasoning_parser(engine: Any, config: ServerConfig) -> ReasoningParser | None:
    if config.reasoning_parser is None:
        return None
    parser = make_reasoning_parser(config.reasoning_parser, engine.tokenizer)
    logger.info(
        "reasoning parser %s: tags told %s",
        parser.name,
        "by token id" if parser.tag_ids is not None else "by text (not single tokens here)",
    )
    return parser


def max_waiting(max_num_seqs: int, requested: int | None) -> int | None:
    """The waiting-queue bound: DEFAULT_WAITING_PER_RUNNING × max_num_seqs unless set; a
    negative setting means unbounded (None)."""
    if requested is None:
        return DEFAULT_WAITING_PER_RUNNING * max_num_seqs
    return None if requested < 0 else requested


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tokenbus", version=tokenbus.__version__, lifespan=_lifespan(state))
    app.state.server = state
    install_error_handlers(app, state.ctx.known_params)
    _add_openai_routes(app, state)
    _add_service_routes(app, state)
    if state.config.enable_lora_runtime_updates:
        add_lora_routes(app, state.ctx.loras)
    if state.config.enable_xray:
        from tokenbus.api.openai.xray import add_xray_routes

        add_xray_routes(app, state.ctx.engine, state.ctx.served_model_names[0])
    # Added last = outermost: the key is checked before any body is read.
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.config.max_request_body_bytes)
    if state.config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.config.api_key)
    config = state.config
    if config.allowed_origins:
        # Outermost: a browser's preflight OPTIONS carries no key, and every answer, a 401 too,
        # needs the CORS headers for the page to read it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_credentials=config.allow_credentials,
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
        )
    return app


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    completions = CompletionServing(state.ctx)
    chat = ChatServing(state.ctx)
    responses = ResponsesServing(chat)
    embeddings = EmbeddingServing(state.ctx)
    tokenize = TokenizeServing(state.ctx, chat)

    @app.post("/v1/completions")
    async def create_completion(request: p.CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: p.ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: p.EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.create(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    add_messages_routes(app, MessagesServing(chat))

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models() -> p.ModelList:
        return tokenize.models()

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def retrieve_model(model: str) -> p.ModelCard:
        return tokenize.model_card(model)

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info() -> p.TokenizerInfoResponse:
        return tokenize.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize_route(request: p.TokenizeRequest) -> p.TokenizeResponse:
        return await tokenize.tokenize(request)

    @app.post("/detokenize")
    async def detokenize_route(request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return await tokenize.detokenize(request)

    add_sagemaker_routes(app, chat, completions, embeddings)


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if state.ctx.is_draining:
            return error_response(ServiceUnavailableError("The server is shutting down."))
        try:
            await state.ctx.engine.check_health()
        except Exception as exc:
            return error_response(ServiceUnavailableError(f"The engine is not running: {exc}"))
        if (stalled := state.ctx.stalled_for_s) is not None:
            return error_response(
                ServiceUnavailableError(
                    f"The engine has had work but completed no step for {stalled:.0f} s."
                )
            )
        return Response(status_code=200)

    app.add_api_route("/ping", health, methods=["GET", "POST", "HEAD"])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def load() -> JSONResponse:
        # vLLM's: the generation and embedding requests in flight (admitted, not yet answered).
        return JSONResponse({"server_load": state.ctx.admission.num_requests})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(p.VersionResponse(version=tokenbus.__version__).model_dump())


def _lifespan(state: ServerState):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.tasks.append(asyncio.create_task(_watch_engine(state), name="engine-watchdog"))
        if state.log_stats is not None and state.config.log_interval > 0:
            state.tasks.append(asyncio.create_task(_log_stats(state), name="stats-log"))
        try:
            yield
        finally:
            await cancel_all(state.tasks)

    return lifespan


async def _watch_engine(state: ServerState) -> None:
    """Mark a stalled engine (and its recovery); exit (status 1) once the engine has died and
    in-flight requests got their errors."""
    engine = state.ctx.engine
    while not engine.errored:
        _check_progress(state)
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    logger.error("the engine died (%s); failing in-flight requests and exiting", engine.dead_error)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEAD_INFLIGHT_WAIT_S
    while state.ctx.admission.num_in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    await asyncio.sleep(state.config.dead_exit_delay)
    state.exit_code = 1
    state.request_exit(1)


def _check_progress(state: ServerState) -> None:
    timeout = state.config.engine_stall_timeout
    if not timeout:
        return
    ctx = state.ctx
    silent = ctx.engine.seconds_without_progress()
    stalled = silent is not None and silent > timeout
    if stalled and ctx.stalled_for_s is None:
        logger.error(
            "the engine has had work but completed no step for %.0f s (--engine-stall-timeout "
            "%g): /health answers 503 and new requests are refused until it steps again; "
            "its threads' stacks follow in its log",
            silent,
            timeout,
        )
        ctx.engine.dump_engine_stacks()
    elif not stalled and ctx.stalled_for_s is not None:
        logger.warning(
            "the engine is stepping again after a stall of %.0f s or more", ctx.stalled_for_s
        )
    ctx.stalled_for_s = silent if stalled else None


async def _log_stats(state: ServerState) -> None:
    while True:
        await asyncio.sleep(state.config.log_interval)
        state.log_stats.log()


# ---------------------------------------------------------------------------------------------
# Process life cycle


class _Server(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT only start a graceful shutdown.

    uvicorn re-raises the signal after its own shutdown, which would kill this process before
    the engine (a child process) is shut down; here run_server shuts the engine down and
    returns an exit status instead.
    """

    on_signal: Callable[[], None] = staticmethod(lambda: None)

    @contextlib.contextmanager
    def capture_signals(self):
        def handle(sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            self.on_signal()

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def served_model_names(args: Any, config: ServerConfig) -> list[str]:
    return [config.served_model_name or args.model or DEFAULT_MODEL_NAME]


def run_server(
    args: Any,
    config: ServerConfig,
    sock: socket.socket,
    setup: EngineSetup,
    tokenizer: Any,
    client: EngineCoreClient,
) -> int:
    """Serve on `sock` with the started engine (launch.serve) until SIGTERM or engine death;
    shut the engine down and return the exit status."""
    names = served_model_names(args, config)
    try:
        from tokenbus.engine.async_llm import AsyncLLM

        registry = CollectorRegistry()
        prometheus = PrometheusStatLogger(
            registry, names[0], args.max_model_len or 32768, num_engines=args.data_parallel_size
        )
        log_stats = LoggingStatLogger()
        engine = AsyncLLM(setup, tokenizer, client, stat_loggers=[prometheus, log_stats])
    except BaseException:
        client.shutdown()
        sock.close()
        raise
    state: ServerState | None = None
    try:
        state = ServerState(
            config, make_serving_context(engine, config, names), registry, log_stats
        )
        server = _Server(
            uvicorn.Config(
                build_app(state),
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=config.shutdown_timeout,
                h11_max_incomplete_event_size=4 * 1024 * 1024,
            )
        )
        server.on_signal = lambda: setattr(state.ctx, "is_draining", True)
        state.request_exit = lambda code: setattr(server, "should_exit", True)
        host, port = sock.getsockname()[:2]
        logger.info("Serving %s on http://%s:%d", names[0], host, port)
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        engine.shutdown()
        sock.close()
    logger.info("server stopped (exit status %d)", state.exit_code)
    return state.exit_code
