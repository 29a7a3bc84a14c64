"""What every OpenAI endpoint shares: model check, admission, validation, responding (L5)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.errors import NotFoundError, ServiceUnavailableError
from tokenbus.api.openai.protocol import OpenAIRequest
from tokenbus.api.openai.request_params import ParamLimits
from tokenbus.api.openai.streaming import SSEResponse, cancel_on_disconnect
from tokenbus.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
# No token is longer than this many characters in the tokenizers we serve; longer text cannot
# fit the context, and refusing it by length spares the event loop from tokenizing megabytes.
MAX_CHARS_PER_TOKEN = 32


class Admission:
    """Bounds the sequences in flight (an `n`-way request counts n) so that the waiting queue
    stays at most `max_waiting` deep beyond what the engine runs at once.

    Checked and counted synchronously (no await in between), so concurrent requests on the
    event loop cannot all slip past the bound.
    """

    def __init__(self, max_running: int, max_waiting: int | None) -> None:
        self.limit = None if max_waiting is None else max_running + max_waiting
        self.num_in_flight = 0

    def acquire(self, num_seqs: int) -> "Ticket":
        if self.limit is not None and self.num_in_flight + num_seqs > self.limit:
            raise ServiceUnavailableError(
                "The server is overloaded: the request queue is full. Retry later.",
                headers={"Retry-After": RETRY_AFTER_S})
        self.num_in_flight += num_seqs
        return Ticket(self, num_seqs)


@dataclass
class Ticket:
    admission: Admission
    num_seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.num_in_flight -= self.num_seqs


@dataclass
class ServingContext:
    """The state the endpoints share; built once per app by the server factory."""

    engine: Any  # AsyncLLM (or a test double with the same interface)
    served_model_names: list[str]
    limits: ParamLimits
    admission: Admission
    is_draining: bool = False
    known_params: frozenset[str] = field(default_factory=frozenset)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine

    def preflight(self, request: OpenAIRequest, model: str | None) -> None:
        """Checks that need no tokenization: the server can take work, the model exists."""
        if self.ctx.is_draining:
            raise ServiceUnavailableError("The server is shutting down.")
        if self.engine.errored:
            raise ServiceUnavailableError(f"The engine is not running: {self.engine.dead_error}")
        if model is not None and model not in self.ctx.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")
        unknown = request.unknown_fields()
        if unknown:
            logger.warning("ignored unknown request fields: %s", ", ".join(unknown))

    def check_text_length(self, name: str, num_chars: int) -> None:
        max_model_len = self.engine.input_processor.max_model_len
        if num_chars > MAX_CHARS_PER_TOKEN * max_model_len:
            raise ValueError(f"{name}: {num_chars} characters cannot fit this model's maximum "
                             f"context length of {max_model_len} tokens")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        processor = self.engine.input_processor
        processor.validate_params(params)
        processor.validate_prompt(prompt_token_ids, params)

    def response_model_name(self, model: str | None) -> str:
        return model or self.ctx.model_name

    def decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def respond(self, raw: Request, stream: bool, num_seqs: int, run: Any) -> Response:
        """Admit `num_seqs` sequences, then answer with `run` as an event stream or as one body.

        The admission slot is held until the stream closes or the body is built. Engine requests
        need no abort here: engine.generate() aborts its own when closed early, cancelled (a
        disconnect) or failing.
        """
        ticket = self.ctx.admission.acquire(num_seqs)
        if stream:
            return SSEResponse(self._stream(run), on_close=ticket.release)
        try:
            response = await cancel_on_disconnect(raw, self._complete(run))
        finally:
            ticket.release()
        # None: the client disconnected first; 499 is nginx's "client closed request".
        return Response(status_code=499) if response is None else response

    async def _complete(self, run: Any) -> Response:
        """The whole answer to a non-streaming request (endpoints that generate override it)."""
        raise NotImplementedError

    def _stream(self, run: Any) -> AsyncIterator[bytes]:
        """The server-sent events of a streaming request (endpoints that generate override it)."""
        raise NotImplementedError


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
