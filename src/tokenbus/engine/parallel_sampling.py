"""Parallel sampling (n > 1): one request runs as n child requests in the engine (L4).

Both front ends (LLMEngine, AsyncLLM) take a request the input processor has checked, fan it
out here and register the children with the output processor, which joins their outputs back
into the parent's.
"""

from __future__ import annotations

import msgspec

from tokenbus.engine.output_processor import OutputKind, OutputProcessor, ParentRequest
from tokenbus.engine.outputs import RequestMetrics
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Children sample independently: n=1 each, seed + index when seeded (as vLLM does). They
    share the prompt, so only the first computes its logprobs."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return params.clone(n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def fan_out(request: EngineRequest) -> list[EngineRequest]:
    """The children of a checked request (the request itself when n == 1). A child only drops
    what its parent asked for (n, prompt logprobs) or moves its seed, so it is not checked
    again."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    return [
        msgspec.structs.replace(
            request, request_id=child_id, sampling_params=child_params(params, i)
        )
        for i, child_id in enumerate(child_request_ids(request.request_id, params.n))
    ]


def register_children(
    output_processor: OutputProcessor, request: EngineRequest, prompt: str | None, kind: OutputKind
) -> list[EngineRequest]:
    """Fan a checked request out and register every child (none if building one fails); return
    the children for the engine."""
    children = fan_out(request)
    parent = ParentRequest(
        request.request_id,
        prompt,
        request.prompt_token_ids,
        request.sampling_params.n,
        kind,
        RequestMetrics(arrival_time=request.arrival_time),
    )
    for i, child in enumerate(children):
        output_processor.add_request(parent, child.request_id, i, child.sampling_params)
    return children
