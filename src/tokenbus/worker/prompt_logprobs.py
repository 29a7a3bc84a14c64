"""Logprobs of prompt tokens, for the prefill chunks of requests that ask for them (L3).

The hidden state at position p predicts token p + 1. A chunk covering positions [first, stop)
of a P-token prompt therefore yields the logprobs of prompt tokens first + 1 … min(stop, P - 1);
the prompt's first token has none, and the hidden state at P - 1 predicts the first output
token (that one is sampled, not reported here). Logits are raw (no temperature, penalties or
grammar), as vLLM reports them, and exist for at most LOGITS_SLICE positions at a time:
a 2048-token chunk of a 49k-token vocabulary would otherwise hold 400 MB of them.
"""

from __future__ import annotations

import torch

from tokenbus.protocol import TokenLogprobs
from tokenbus.worker.input_batch import PreparedBatch
from tokenbus.worker.sampler import gather_logprobs, to_token_logprobs

LOGITS_SLICE = 256


def compute_prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, batch: PreparedBatch
) -> tuple[list[list[TokenLogprobs] | None], list[int]] | None:
    """Per request in batch order: its chunk's prompt logprobs ([] when the chunk predicts no
    prompt token; None when it did not ask), and the prompt position of the chunk's first entry
    (a request preempted mid-prefill recomputes from position 1: the front end must know where
    entries belong); None for the whole batch when nobody asked."""
    rows: list[int] = []  # rows of `hidden`
    targets: list[int] = []  # the prompt token each row predicts
    num_top: list[int] = []  # each row's top-n
    owners: list[int] = []  # each row's batch index
    asked = False
    for i, req in enumerate(batch.requests):
        state = req.state
        n = state.sampling_params.prompt_logprobs
        if n is None:
            continue
        asked = True
        first, start = state.num_computed_tokens, batch.ctx.query_start_loc[i]
        last_target = min(first + req.num_new_tokens, len(state.prompt_token_ids) - 1)
        for position in range(first, last_target):
            rows.append(start + position - first)
            targets.append(state.prompt_token_ids[position + 1])
            num_top.append(n)
            owners.append(i)
    if not asked:
        return None
    result: list[list[TokenLogprobs] | None] = [
        [] if req.state.sampling_params.prompt_logprobs is not None else None
        for req in batch.requests
    ]
    starts = [req.state.num_computed_tokens + 1 for req in batch.requests]
    for begin in range(0, len(rows), LOGITS_SLICE):
        end = begin + LOGITS_SLICE
        row_index = torch.tensor(rows[begin:end], dtype=torch.int64, device=hidden.device)
        logprobs = model.compute_logits(hidden[row_index]).float().log_softmax(-1)
        target = torch.tensor(targets[begin:end], dtype=torch.int64, device=hidden.device)
        tensors = gather_logprobs(logprobs, max(num_top[begin:end]), target)
        for owner, entry in zip(owners[begin:end], to_token_logprobs(tensors, num_top[begin:end])):
            result[owner].append(entry)
    return result, starts
