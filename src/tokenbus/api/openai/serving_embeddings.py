"""POST /v1/embeddings (L5): each input runs through the scheduler as an embedding request
(SamplingParams.pooling, --pooler) and comes back as its pooled, L2-normalised final hidden
state; `encoding_format: "base64"` packs it as little-endian float32, as OpenAI does."""

from __future__ import annotations

import base64
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from tokenbus.api.openai.request_params import make_usage, truncate_prompt
from tokenbus.api.openai.serving_completions import split_prompts
from tokenbus.api.openai.serving_engine import OpenAIServing, new_request_id
from tokenbus.api.openai.streaming import merge_async_iterators
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams


@dataclass
class EmbeddingRun:
    request_id: str
    request: EmbeddingRequest
    model: str
    engine_requests: list[EngineRequest]  # one per input, built (and so checked) by the processor

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt_token_ids for r in self.engine_requests]


class EmbeddingServing(OpenAIServing):
    async def create(self, request: EmbeddingRequest, raw: Request) -> Response:
        self.preflight(request, request.model)
        if request.dimensions is not None:
            raise ValueError(
                "dimensions: this model's embeddings have one size; leave dimensions out"
            )
        inputs = split_prompts(request.input)
        self.ctx.limits.caps.check(
            "max_sequences_per_request", len(inputs), "number of inputs", "input"
        )
        self.check_text_length("input", sum(len(p) for p in inputs if isinstance(p, str)))
        self.ctx.admission.check_room(len(inputs))
        run = await self.prepare(self._prepare, request, inputs)
        self.log_user(run.request_id, request.user)
        return await self.respond(raw, False, len(run.prompts), run)

    def _prepare(self, request: EmbeddingRequest, inputs: list[str | list[int]]) -> EmbeddingRun:
        processor = self.engine.input_processor
        params = SamplingParams(max_tokens=1, pooling=self.engine.config.model.pooler)
        request_id = new_request_id("embd")
        engine_requests = []
        for i, item in enumerate(inputs):
            _, token_ids = processor.tokenize(
                item if isinstance(item, str) else {"prompt_token_ids": item}
            )
            token_ids = truncate_prompt(
                token_ids,
                request.truncate_prompt_tokens,
                self.ctx.limits.max_model_len,
                request.truncation_side,
            )
            engine_requests.append(
                processor.make_request(
                    f"{request_id}-{i}",
                    token_ids,
                    params,
                    lora_request=self.lora_for(request.model),
                )
            )
        self.check_request_tokens(sum(len(r.prompt_token_ids) for r in engine_requests))
        return EmbeddingRun(
            request_id, request, self.response_model_name(request.model), engine_requests
        )

    async def _complete(self, run: EmbeddingRun) -> Response:
        vectors: dict[int, list[float]] = {}
        generators = [self.engine.generate_request(r) for r in run.engine_requests]
        # Leaving early (a disconnect cancels us) closes every engine stream: each aborts its
        # request.
        async with aclosing(merge_async_iterators(*generators)) as outputs:
            async for index, out in outputs:
                if out.pooled is not None:
                    vectors[index] = out.pooled
        data = [
            EmbeddingData(index=i, embedding=_encode(vectors[i], run.request.encoding_format))
            for i in range(len(run.prompts))
        ]
        body = EmbeddingResponse(
            id=run.request_id,
            model=run.model,
            data=data,
            usage=make_usage([len(p) for p in run.prompts], None, 0),
        )
        return Response(
            body.model_dump_json(exclude={"usage": {"completion_tokens"}}),
            media_type="application/json",
        )


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
