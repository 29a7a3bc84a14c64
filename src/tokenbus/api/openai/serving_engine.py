"""What every OpenAI endpoint shares: model check, admission, validation, responding (L5).

The order a request goes through, the same for every endpoint:

    preflight (event loop: cheap checks, no tokenizing) → prepare (a preparation thread:
    caps, tokenizing, chat template; the input processor builds and checks the engine
    requests, grammar included) → admission → generate, under the request's deadline →
    respond (one body, or server-sent events)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.errors import (
    ClientClosedRequestError,
    NotFoundError,
    RequestTimeoutError,
    ServiceUnavailableError,
    error_event_body,
)
from tokenbus.api.openai.protocol import OpenAIRequest
from tokenbus.api.openai.reasoning_parsers import ReasoningParser
from tokenbus.api.openai.request_params import ParamLimits
from tokenbus.api.openai.serving_lora import LoRAModules
from tokenbus.api.openai.streaming import DONE_EVENT, SSEResponse, cancel_on_disconnect, sse_event
from tokenbus.api.openai.text_checks import find_lone_surrogate
from tokenbus.api.openai.tool_parsers import ToolCallParser
from tokenbus.api.openai.unsupported import check_unsupported
from tokenbus.protocol import LoRARequest
from tokenbus.sampling_params import SamplingParams
from tokenbus.structured.validator import CHECK_CANCELLED
from tokenbus.utils.log import log_safe

if TYPE_CHECKING:
    from tokenbus.engine.stats import IterationStats
    from tokenbus.protocol import EngineRequest, SchedulerStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIN_RETRY_AFTER_S = 3  # sooner, a refused client only finds the queue as full as it left it
MAX_RETRY_AFTER_S = 60
RATE_HORIZON_S = 30.0  # how far back the drain-rate estimates look
RATE_WINDOW = 256  # finished requests the drain-rate estimate looks back over (at most)
RATE_MIN_SPAN_S = 1.0  # a throughput is never measured over less (the first steps of a burst)
UNKNOWN_FIELDS_LOGGED = 5  # names a warning about ignored fields lists; the rest are counted
PREPARE_THREADS = 4


class Admission:
    """Bounds the sequences in flight (an `n`-way request counts n) so that the waiting queue
    stays at most `max_waiting` deep beyond what the engine runs at once.

    Checked and counted synchronously (no await in between), so concurrent requests on the
    event loop cannot all slip past the bound.

    A refusal's Retry-After is the time the sequences ahead of it (those queued beyond the
    running batch, plus its own) need to get a slot, at the best-known rate over the last
    RATE_HORIZON_S seconds:

    1. sequences finished there (two or more): `queued / finished per second`;
    2. otherwise (a burst: nothing finished yet) the engine's generation throughput G (tokens
       per second, from its step reports: see `record`) and the mean token budget L of the
       sequences in flight (their max_tokens, an upper bound while none has finished to say
       how long they really run): slots free at G / L per second, so `queued × L / G`;
    3. otherwise (no step reported yet): MIN_RETRY_AFTER_S per running batch of the queue,
       `ceil(queued / max_running) × MIN_RETRY_AFTER_S`.

    The answer is at least MIN_RETRY_AFTER_S and at most MAX_RETRY_AFTER_S seconds.
    """

    def __init__(
        self, max_running: int, max_waiting: int | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_running = max_running
        self.limit = None if max_waiting is None else max_running + max_waiting
        self.num_in_flight = 0  # sequences
        self.num_requests = 0  # requests, whatever their n: GET /load's server_load
        self._clock = clock
        self._finished: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW)
        # Generation tokens the engine reported, per second: [start of the second, tokens].
        self._generated: collections.deque[list] = collections.deque()
        self._budget_in_flight = 0  # max_tokens over the in-flight sequences that have one
        self._num_budgeted = 0

    def check_room(self, num_seqs: int) -> None:
        """Raise the 503 now if `num_seqs` would not be admitted (before preparing them)."""
        if self.limit is not None and self.num_in_flight + num_seqs > self.limit:
            raise ServiceUnavailableError(
                "The server is overloaded: the request queue is full. Retry later.",
                headers={"Retry-After": str(self.retry_after_s(num_seqs))},
            )

    def acquire(self, num_seqs: int, max_new_tokens: int | None = None) -> Ticket:
        """Admit `num_seqs` sequences that generate at most `max_new_tokens` in all (None: not
        a generation, e.g. embeddings)."""
        self.check_room(num_seqs)
        self.num_in_flight += num_seqs
        self.num_requests += 1
        if max_new_tokens is not None:
            self._budget_in_flight += max_new_tokens
            self._num_budgeted += num_seqs
        return Ticket(self, num_seqs, max_new_tokens)

    def release(self, num_seqs: int, max_new_tokens: int | None = None) -> None:
        self.num_in_flight -= num_seqs
        self.num_requests -= 1
        if max_new_tokens is not None:
            self._budget_in_flight -= max_new_tokens
            self._num_budgeted -= num_seqs
        self._finished.append((self._clock(), num_seqs))

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """A StatLogger (engine/stats.py): every batch of engine outputs, on the event loop."""
        if iteration_stats is None or not iteration_stats.num_generation_tokens:
            return
        now = self._clock()
        if self._generated and now - self._generated[-1][0] < 1.0:
            self._generated[-1][1] += iteration_stats.num_generation_tokens
        else:
            self._generated.append([now, iteration_stats.num_generation_tokens])
        while now - self._generated[0][0] > RATE_HORIZON_S:
            self._generated.popleft()

    def retry_after_s(self, num_seqs: int = 1) -> int:
        """Seconds until `num_seqs` more sequences would find a slot (the class docstring)."""
        queued = max(self.num_in_flight - self.max_running, 0) + num_seqs
        seconds = queued * self._seconds_per_slot()
        if math.isnan(seconds):  # nothing measured yet: a batch of slots per floor's worth
            seconds = math.ceil(queued / self.max_running) * MIN_RETRY_AFTER_S
        return int(min(max(math.ceil(seconds), MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S))

    def _seconds_per_slot(self) -> float:
        """Seconds between two sequences' slots coming free; NaN when nothing tells."""
        now = self._clock()
        finished = [(t, n) for t, n in self._finished if now - t <= RATE_HORIZON_S]
        if len(finished) >= 2:
            # Sequences finished after the first of the horizon, over the time since it.
            span = now - finished[0][0]
            num_finished = sum(n for _, n in finished[1:])
            return span / num_finished if num_finished else math.nan
        generated = [(t, n) for t, n in self._generated if now - t <= RATE_HORIZON_S]
        if generated and self._num_budgeted:
            span = max(now - generated[0][0], RATE_MIN_SPAN_S)
            tokens_per_s = sum(n for _, n in generated) / span
            mean_budget = self._budget_in_flight / self._num_budgeted
            return mean_budget / tokens_per_s
        return math.nan


@dataclass
class Ticket:
    admission: Admission
    num_seqs: int
    max_new_tokens: int | None = None
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.release(self.num_seqs, self.max_new_tokens)


@dataclass
class ServingContext:
    """The state the endpoints share; built once per app by the server factory."""

    engine: Any  # AsyncLLM (or a test double with the same interface)
    served_model_names: list[str]
    limits: ParamLimits
    admission: Admission
    is_draining: bool = False
    known_params: frozenset[str] = field(default_factory=frozenset)
    request_timeout_s: float | None = None  # a request's deadline, from arrival to its last byte
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    # Logprob tokens as "token_id:N" unless a request says otherwise (vLLM's flag).
    return_tokens_as_token_ids: bool = False
    tool_parser: ToolCallParser | None = None  # tool_choice "auto": --enable-auto-tool-choice
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    loras: LoRAModules | None = None  # adapters served as model names (--lora-modules)
    # Tokenizing, chat templates and grammar checks run here, never on the event loop.
    prepare_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, "prepare")
    )
    # Seconds the engine has had work but completed no step; set by the server's watchdog.
    stalled_for_s: float | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine

    def preflight(self, request: OpenAIRequest, model: str | None) -> None:
        """Checks that need no tokenization: the server can take work, the model exists, every
        string is valid Unicode (a lone surrogate would fail later, at the engine's socket)."""
        if self.ctx.is_draining:
            raise ServiceUnavailableError("The server is shutting down.")
        if self.engine.errored:
            raise ServiceUnavailableError(f"The engine is not running: {self.engine.dead_error}")
        if self.ctx.stalled_for_s is not None:
            raise ServiceUnavailableError(
                f"The engine has completed no step for {self.ctx.stalled_for_s:.0f} s.",
                headers={"Retry-After": "5"},
            )
        if (
            model is not None
            and model not in self.ctx.served_model_names
            and self.lora_for(model) is None
        ):
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")
        if (path := find_lone_surrogate(request)) is not None:
            raise ValueError(
                f"{path}: contains a lone UTF-16 surrogate, which is not valid Unicode text"
            )
        unknown = check_unsupported(request)
        if unknown:
            shown = ", ".join(log_safe(name, 40) for name in unknown[:UNKNOWN_FIELDS_LOGGED])
            num_more = len(unknown) - UNKNOWN_FIELDS_LOGGED
            more = f" and {num_more} more" if num_more > 0 else ""
            logger.warning("ignored %d unknown request field(s): %s%s", len(unknown), shown, more)

    async def prepare(self, fn: Callable[..., T], *args: Any, raw: Request | None = None) -> T:
        """Run `fn` (tokenizing, templates, grammar checks) on a preparation thread. If the
        client of `raw` leaves meanwhile (499), a grammar check `fn` runs is stopped through
        CHECK_CANCELLED: the thread itself cannot be, but the compile's process and slot are."""
        cancelled = threading.Event()
        context = contextvars.copy_context()
        context.run(CHECK_CANCELLED.set, cancelled)
        work = asyncio.get_running_loop().run_in_executor(
            self.ctx.prepare_pool, functools.partial(context.run, fn, *args)
        )
        try:
            if raw is None:
                return await work
            result = await cancel_on_disconnect(raw, work)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        if result is None:  # what preparation returns is never None: the client left
            cancelled.set()
            raise ClientClosedRequestError("The client closed the request during preparation.")
        return result

    def check_text_length(self, name: str, num_chars: int) -> None:
        self.ctx.limits.caps.check("max_input_chars", num_chars, "number of characters", name)

    def check_messages(
        self, messages: list, tools: list | None = None, functions: list | None = None
    ) -> None:
        """The caps on a chat (cheap: before anything is rendered). Tools and the calls in the
        history are rendered too: their JSON counts like text."""
        caps = self.ctx.limits.caps
        caps.check("max_chat_messages", len(messages), "number of messages", "messages")
        tools = (tools or []) + (functions or [])
        caps.check("max_tools", len(tools), "number of tools", "tools")
        num_chars = sum(_content_chars(m) for m in messages) + (
            len(json.dumps(tools)) if tools else 0
        )
        num_chars += sum(
            len(json.dumps(m["tool_calls"]))
            for m in messages
            if isinstance(m, dict) and m.get("tool_calls")
        )
        self.check_text_length("messages", num_chars)

    def check_request_tokens(self, num_tokens: int) -> None:
        self.ctx.limits.caps.check(
            "max_request_tokens",
            num_tokens,
            "number of tokens (prompt + max_tokens over all sequences)",
            "max_tokens",
        )

    def check_prompt_logprobs(self, prompts: list[tuple[int, SamplingParams]]) -> None:
        """What prompt logprobs cost the response (and the engine's output), bounded over the
        request's (prompt length, params) pairs."""
        entries = sum(
            n * (1 + params.prompt_logprobs)
            for n, params in prompts
            if params.prompt_logprobs is not None
        )
        self.ctx.limits.caps.check(
            "max_prompt_logprob_entries",
            entries,
            "prompt positions × (1 + prompt_logprobs)",
            "prompt_logprobs",
        )

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return self.ctx.loras.get(model) if self.ctx.loras is not None else None

    def response_model_name(self, model: str | None) -> str:
        return model or self.ctx.model_name

    @staticmethod
    def request_id_for(prefix: str, requested: str | None) -> str:
        """The response's (and engine's) id: "<prefix>-<request_id>" when the client chose one
        (vLLM's `request_id`; a second one running under the same id is a 400), else random."""
        return new_request_id(prefix) if requested is None else f"{prefix}-{requested}"

    def tokens_as_ids(self, request: Any) -> bool:
        """return_tokens_as_token_ids: the request's choice, else the server's."""
        chosen = request.return_tokens_as_token_ids
        return self.ctx.return_tokens_as_token_ids if chosen is None else chosen

    @staticmethod
    def log_user(request_id: str, user: str | None) -> None:
        """OpenAI's `user` names the end user behind a request, for tracing abuse: it goes in
        the log beside the request's id (nothing else reads it)."""
        if user is not None:
            logger.info("request %s: user %s", request_id, log_safe(user, 100))

    def decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def generation_budget(self, requests: list[EngineRequest]) -> int:
        """The most tokens `requests` generate in all (n each), for the admission's estimates."""
        max_model_len = self.ctx.limits.max_model_len
        return sum(
            r.sampling_params.n
            * (r.sampling_params.max_tokens or max(max_model_len - len(r.prompt_token_ids), 1))
            for r in requests
        )

    async def respond(
        self,
        raw: Request,
        stream: bool,
        num_seqs: int,
        run: Any,
        max_new_tokens: int | None = None,
    ) -> Response:
        """Admit `num_seqs` sequences (that generate at most `max_new_tokens` in all), then
        answer with `run` as an event stream or as one body.

        The admission slot is held until the stream closes or the body is built. Engine requests
        need no abort here: engine.generate() aborts its own when closed early, cancelled (a
        disconnect) or failing.
        """
        ticket = self.ctx.admission.acquire(num_seqs, max_new_tokens)
        deadline = self._deadline()
        if stream:
            return SSEResponse(
                self._stream_before(self._stream(run), deadline), on_close=ticket.release
            )
        try:
            response = await cancel_on_disconnect(raw, self._complete_before(run, deadline))
        finally:
            ticket.release()
        # None: the client disconnected first; 499 is nginx's "client closed request".
        return Response(status_code=499) if response is None else response

    def _deadline(self) -> float | None:
        timeout = self.ctx.request_timeout_s
        return None if not timeout else asyncio.get_running_loop().time() + timeout

    def _timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"The request ran past the server's {self.ctx.request_timeout_s:g} s "
            f"limit (--request-timeout) and was aborted."
        )

    async def _complete_before(self, run: Any, deadline: float | None) -> Response:
        # Cancelling _complete closes its engine stream, which aborts the request in the engine.
        try:
            async with asyncio.timeout_at(deadline):
                return await self._complete(run)
        except TimeoutError:
            raise self._timeout_error() from None

    async def _stream_before(
        self, events: AsyncIterator[bytes], deadline: float | None
    ) -> AsyncIterator[bytes]:
        """`events` until the deadline; then an error event, [DONE], and the stream closed (so
        that its engine request is aborted)."""
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    yield sse_event(error_event_body(self._timeout_error(), self.ctx.known_params))
                    yield DONE_EVENT
                    return
                yield event
        finally:
            await events.aclose()

    async def _complete(self, run: Any) -> Response:
        """The whole answer to a non-streaming request (endpoints that generate override it)."""
        raise NotImplementedError

    def _stream(self, run: Any) -> AsyncIterator[bytes]:
        """The server-sent events of a streaming request (endpoints that generate override it)."""
        raise NotImplementedError


def _content_chars(message: Any) -> int:
    """Characters of a chat message's text: a string content, or its text parts."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
