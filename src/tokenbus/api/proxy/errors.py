"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (L5).

The same shape as api/openai/errors.py, written out here because that module reaches into the
engine and the proxy must not. Errors from the instances themselves are relayed unchanged.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse


class ProxyError(Exception):
    """A request the proxy answers itself: bad input, a timeout, no instance to serve it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_type(status: int) -> str:
    """`BadRequestError`, `ServiceUnavailableError`, ... as the openai client names them."""
    if status == 413:
        return "RequestTooLargeError"  # HTTPStatus says "Request Entity Too Large"
    name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return name if name.endswith("Error") else name + "Error"  # 500: InternalServerError


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


def error_response(error: ProxyError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status, error.message, error.param),
        status_code=error.status,
        headers=error.headers,
    )
