"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` (L5).

The HTTP status always equals `code`. Every path that can fail (validation, auth, body size,
overload, a dead engine, a bug) ends up here, so clients see one shape everywhere: on the
Anthropic routes (/v1/messages…) that shape is Anthropic's,
`{"type": "error", "error": {"type", "message"}}`, with the same status.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenbus.api.openai.messages_protocol import AnthropicErrorInfo, AnthropicErrorResponse
from tokenbus.api.openai.protocol import ErrorInfo, ErrorResponse
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.structured.compile_pool import CompileCapacityError
from tokenbus.utils.log import log_safe

logger = logging.getLogger(__name__)

# Engine and parameter errors start with the field they are about ("top_p must be in (0, 1]…",
# "prompt: this model's maximum context length…"); that leading name becomes `param`.
_LEADING_NAME = re.compile(r"^([A-Za-z_]\w*)[\w.\[\]]*[:\s]")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error types by the status they come with; any other status is an "api_error".
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    status: int = 500
    type: str = "InternalServerError"

    def __init__(
        self, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers


class BadRequestError(APIError):
    status, type = 400, "BadRequestError"


class AuthenticationError(APIError):
    status, type = 401, "AuthenticationError"


class NotFoundError(APIError):
    status, type = 404, "NotFoundError"


class RequestTimeoutError(APIError):
    status, type = 408, "RequestTimeoutError"


class RequestTooLargeError(APIError):
    status, type = 413, "RequestTooLargeError"


class ClientClosedRequestError(APIError):
    """The client went away before its answer was ready (nginx's 499); nobody reads the body."""

    status, type = 499, "ClientClosedRequest"


class ServiceUnavailableError(APIError):
    status, type = 503, "ServiceUnavailableError"


def speaks_anthropic(path: str) -> bool:
    """Whether the route at `path` answers in Anthropic's shapes."""
    return path.rstrip("/") == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_body(
    status: int, message: str, type_: str, param: str | None = None, anthropic: bool = False
) -> dict:
    message = _ADDRESS.sub("", message)
    if anthropic:
        info = AnthropicErrorInfo(
            type=ANTHROPIC_ERROR_TYPES.get(status, "api_error"), message=message
        )
        return AnthropicErrorResponse(error=info).model_dump()
    info = ErrorInfo(message=message, type=type_, param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_bytes(
    status: int, message: str, type_: str, param: str | None = None, anthropic: bool = False
) -> bytes:
    return json.dumps(error_body(status, message, type_, param, anthropic)).encode()


def to_api_error(exc: BaseException, known_params: frozenset[str] = frozenset()) -> APIError:
    """Map any exception from serving code or the engine onto an APIError."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(f"The engine is not running: {exc}")
    if isinstance(exc, CompileCapacityError):
        return ServiceUnavailableError(
            str(exc), param="structured_outputs", headers={"Retry-After": "5"}
        )
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        message = str(exc)
        match = _LEADING_NAME.match(message)
        param = match.group(1) if match and match.group(1) in known_params else None
        return BadRequestError(message, param)
    if isinstance(exc, NotImplementedError):
        error = APIError(str(exc) or "not implemented")
        error.status, error.type = 501, "NotImplementedError"
        return error
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(f"Internal server error: {type(exc).__name__}")


def error_event_body(
    exc: BaseException, known_params: frozenset[str], anthropic: bool = False
) -> dict:
    """The body of a stream's error event: once a stream's 200 headers are out, a failure can
    no longer change the status, so it goes in the body."""
    error = to_api_error(exc, known_params)
    return error_body(error.status, error.message, error.type, error.param, anthropic)


def error_response(error: APIError, anthropic: bool = False) -> JSONResponse:
    headers = dict(error.headers or {})
    if error.status >= 500 and error.status != 503:
        # Whatever broke may have left this connection's state unknown: close it (only it).
        headers["Connection"] = "close"
    return JSONResponse(
        error_body(error.status, error.message, error.type, error.param, anthropic),
        status_code=error.status,
        headers=headers or None,
    )


def log_client_error(request: Request, error: APIError) -> None:
    """One line per refused request: no traceback (nothing is wrong with the server), the
    client's text escaped and truncated."""
    if error.status < 500 or error.status == 503:
        logger.info(
            "%d %s %s: %s",
            error.status,
            request.method,
            log_safe(request.url.path, 100),
            log_safe(error.message),
        )


def _respond(request: Request, error: APIError) -> JSONResponse:
    return error_response(error, speaks_anthropic(request.url.path))


def install_error_handlers(app: FastAPI, known_params: frozenset[str]) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        log_client_error(request, exc)
        return _respond(request, exc)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Pydantic's 422 becomes 400: OpenAI clients treat 4xx other than 400 as different errors.
        if not request.headers.get("content-type", "").startswith("application/json"):
            error = APIError(
                "Unsupported media type: only 'application/json' request bodies are accepted"
            )
            error.status, error.type = 415, "UnsupportedMediaTypeError"
            log_client_error(request, error)
            return _respond(request, error)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        if first.get("type"):  # pydantic's name for the check, as its own messages end
            message += f" [type={first['type']}]"
        error = BadRequestError(message, loc[0] if loc else None)
        log_client_error(request, error)
        return _respond(request, error)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase.replace(" ", "")
        error = APIError(str(exc.detail), headers=exc.headers)
        error.status, error.type = exc.status_code, f"{phrase}Error"
        return _respond(request, error)

    async def on_other(request: Request, exc: Exception) -> JSONResponse:
        error = to_api_error(exc, known_params)  # logs the traceback of a real 500, once
        log_client_error(request, error)
        return _respond(request, error)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    # Each class by name: starlette's ExceptionMiddleware answers these and is done with them.
    # (A handler for `Exception` would run in ServerErrorMiddleware, which re-raises after
    # answering, so uvicorn logs a 70-line traceback even for a 400; anything else is answered
    # by middleware.InternalErrorMiddleware.)
    for exc_type in (
        ValueError,
        TypeError,
        OverflowError,
        NotImplementedError,
        EngineDeadError,
        CompileCapacityError,
    ):
        app.add_exception_handler(exc_type, on_other)
