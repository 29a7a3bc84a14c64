"""POST /invocations (L5): Amazon SageMaker's one inference route, as vLLM serves it.

SageMaker sends every request to /invocations (and health checks to /ping). The body says
which API it is for: `messages` a chat completion, `prompt` a completion, `input` embeddings;
it is then validated and answered exactly as on that API's own route.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import Response

from tokenbus.api.openai import protocol as p
from tokenbus.api.openai.errors import BadRequestError
from tokenbus.api.openai.serving_chat import ChatServing
from tokenbus.api.openai.serving_completions import CompletionServing
from tokenbus.api.openai.serving_embeddings import EmbeddingServing


def add_sagemaker_routes(
    app: FastAPI,
    chat: ChatServing,
    completions: CompletionServing,
    embeddings: EmbeddingServing,
) -> None:
    # The key that tells the APIs apart → (its request model, its handler).
    routes = {
        "messages": (p.ChatCompletionRequest, chat.create),
        "prompt": (p.CompletionRequest, completions.create),
        "input": (p.EmbeddingRequest, embeddings.create),
    }

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        body = await _json_body(raw_request)
        for key, (model, handler) in routes.items():
            if key in body:
                try:
                    request = model.model_validate(body)
                except ValidationError as exc:
                    # Answered like the API's own route answers a body it cannot read.
                    raise RequestValidationError(exc.errors(include_url=False)) from None
                return await handler(request, raw_request)
        raise BadRequestError(
            "Cannot find a handler for this body: expected a chat completion (messages), "
            "a completion (prompt) or an embeddings request (input)."
        )


async def _json_body(raw_request: Request) -> dict:
    if not raw_request.headers.get("content-type", "").startswith("application/json"):
        # The routes' own validation answers 415 for this; the same here.
        raise RequestValidationError([{"loc": ("body",), "msg": "not JSON", "type": "json"}])
    try:
        body = json.loads(await raw_request.body())
    except (ValueError, RecursionError) as exc:
        raise BadRequestError(f"body: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise BadRequestError("body: expected a JSON object")
    return body
