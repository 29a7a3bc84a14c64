"""Flattening one step's scheduled tokens into model inputs (L3).

Every scheduled token of every request goes into one forward: decodes (one query token) first,
then prefill chunks and multi-token verifications. Inputs are written into persistent,
preallocated host buffers (reused every step, and by a captured-graph path) and then moved to
the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenbus.model.forward_context import ForwardContext
from tokenbus.worker.request_state import CachedRequestState


@dataclass
class ScheduledRequest:
    state: CachedRequestState
    num_new_tokens: int
    draft_token_ids: list[int]
    pools: bool = False  # an embedding request: pooled (worker/pooling.py), never sampled

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1

    @property
    def completes_prompt(self) -> bool:
        return self.state.num_computed_tokens + self.num_new_tokens >= self.state.num_tokens

    @property
    def samples(self) -> bool:
        """Only a chunk that reaches the end of the known tokens produces a token (embedding
        requests never do: they are pooled)."""
        return self.completes_prompt and not self.pools


@dataclass
class PreparedBatch:
    requests: list[ScheduledRequest]  # in batch order
    input_ids: torch.Tensor  # [num_tokens]
    ctx: ForwardContext
    logits_indices: torch.Tensor  # [num_sampled_rows] rows of the hidden states to sample from
    sampling_requests: list[int]  # batch indices of requests that sample, one row each
    num_logits_per_request: list[int]  # rows in logits_indices per sampling request (1 + drafts)


class InputBuffers:
    """Persistent host buffers (numpy views shared with torch) sized for the largest step."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.device = device
        self.input_ids = np.zeros(max_num_tokens, dtype=np.int64)
        self.positions = np.zeros(max_num_tokens, dtype=np.int64)
        self.slot_mapping = np.zeros(max_num_tokens, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.seq_lens = np.zeros(max_num_reqs, dtype=np.int64)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)


def prepare_batch(requests: list[ScheduledRequest], buffers: InputBuffers, block_size: int,
                  kv_caches: list[torch.Tensor]) -> PreparedBatch:
    requests = sorted(requests, key=lambda r: not r.is_decode)  # stable: decodes first
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    sampling_requests: list[int] = []
    num_logits: list[int] = []
    max_blocks = 1
    for i, req in enumerate(requests):
        start, stop = query_start_loc[-1], query_start_loc[-1] + req.num_new_tokens
        _fill_request(req, buffers, block_size, start, stop, i)
        query_start_loc.append(stop)
        seq_lens.append(req.state.num_computed_tokens + req.num_new_tokens)
        max_blocks = max(max_blocks, len(req.state.block_ids))
        if req.samples:
            # Verify drafts: logits at the last 1 + k positions; else only at the last one.
            rows = 1 + len(req.draft_token_ids)
            logits_rows.extend(range(stop - rows, stop))
            sampling_requests.append(i)
            num_logits.append(rows)
    num_tokens, num_reqs = query_start_loc[-1], len(requests)
    to_dev = buffers.to_device
    ctx = ForwardContext(
        positions=to_dev(buffers.positions[:num_tokens]),
        slot_mapping=to_dev(buffers.slot_mapping[:num_tokens]),
        kv_caches=kv_caches,
        block_size=block_size,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=buffers.device),
        block_tables=to_dev(buffers.block_table[:num_reqs, :max_blocks]),
        num_decodes=sum(1 for r in requests if r.is_decode),
    )
    return PreparedBatch(
        requests=requests,
        input_ids=to_dev(buffers.input_ids[:num_tokens]),
        ctx=ctx,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=buffers.device),
        sampling_requests=sampling_requests,
        num_logits_per_request=num_logits,
    )


def _fill_request(req: ScheduledRequest, buffers: InputBuffers, block_size: int,
                  start: int, stop: int, row: int) -> None:
    state = req.state
    first = state.num_computed_tokens
    block_ids = state.block_ids
    buffers.block_table[row, : len(block_ids)] = block_ids
    if req.is_decode:  # the common case, without numpy temporaries
        buffers.input_ids[start] = state.token_ids[first]
        buffers.positions[start] = first
        buffers.slot_mapping[start] = block_ids[first // block_size] * block_size + first % block_size
        return
    # Known tokens first; positions past them are this step's draft tokens.
    known = state.token_ids[first: first + req.num_new_tokens]
    tokens = known + req.draft_token_ids[: req.num_new_tokens - len(known)]
    positions = np.arange(first, first + req.num_new_tokens, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    buffers.input_ids[start:stop] = tokens
    buffers.positions[start:stop] = positions
    # slot = block_id * block_size + offset within the block
    buffers.slot_mapping[start:stop] = blocks[positions // block_size] * block_size + positions % block_size
