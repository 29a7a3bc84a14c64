"""Embedding requests: the prompt's final hidden states pooled into one vector (L3).

    last   the hidden state of the prompt's last token (causal models: the one that saw it all)
    mean   the average over every prompt position, summed chunk by chunk (chunked prefill)

The vector is L2-normalised, as embedding clients expect (cosine similarity = dot product).
"""

from __future__ import annotations

import torch

from tokenbus.worker.input_batch import PreparedBatch


def compute_pooled(hidden: torch.Tensor, batch: PreparedBatch) -> list[list[float] | None] | None:
    """Per request in batch order: its vector when this step completed its prompt, else None;
    None for the whole batch when no embedding request is in it."""
    result: list[list[float] | None] = [None] * len(batch.requests)
    found = False
    for i, req in enumerate(batch.requests):
        state = req.state
        pooling = state.sampling_params.pooling
        if pooling is None:
            continue
        found = True
        # Its own tokens: the first of its rows (a padded step may give it dummy rows after).
        start = batch.ctx.query_start_loc[i]
        chunk = hidden[start : start + req.num_new_tokens].float()
        if pooling == "mean":
            total = chunk.sum(0)
            state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
        if not req.completes_prompt:
            continue
        vector = chunk[-1] if pooling == "last" else state.pooled_sum / len(state.prompt_token_ids)
        result[i] = torch.nn.functional.normalize(vector, dim=-1).tolist()
    return result if found else None
