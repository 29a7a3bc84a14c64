"""Stop conditions checked after each appended token (L1)."""

from __future__ import annotations

from tokenbus.core.request import Request, RequestStatus


def max_output_tokens(request: Request, max_model_len: int) -> int:
    """`max_tokens`, or None meaning: as many as the context allows."""
    limit = request.sampling_params.max_tokens
    room = max_model_len - request.num_prompt_tokens
    return room if limit is None else min(limit, room)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status and return True if the last appended token ends the request.

    Order as in vLLM: min_tokens holds off EOS/stop ids (the sampler also masks them), then
    EOS (unless ignore_eos), then stop token ids, then the length limits.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= max_output_tokens(
        request, max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
