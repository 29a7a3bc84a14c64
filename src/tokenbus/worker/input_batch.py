"""Flattening one step's scheduled tokens into model inputs (L3).

Every scheduled token of every request goes into one forward: decodes (one query token) first,
then prefill chunks and multi-token verifications. Inputs are written into persistent,
preallocated buffers (reused every step, and read at fixed addresses by a captured step):
host staging arrays, copied into device tensors of the same shape on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbus.config import EngineConfig
from tokenbus.core.kv.hybrid import KVGroupLayout
from tokenbus.model.forward_context import ForwardContext, KVGroupInputs
from tokenbus.utils import cdiv
from tokenbus.worker.request_state import CachedRequestState


def max_blocks_per_req(config: EngineConfig) -> int:
    """The block-table width every step buffer takes: a request of max_model_len tokens and
    its k draft lookahead slots, and one block more."""
    spec = config.speculative
    num_spec = spec.num_speculative_tokens if spec is not None else 0
    return cdiv(config.scheduler.max_model_len + num_spec, config.cache.block_size) + 1


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


@dataclass(frozen=True, order=True)
class StepShape:
    """The shape of a padded (captured) step: num_reqs requests of query_len tokens each."""

    num_reqs: int
    query_len: int = 1  # a decode's one token; 1 + k when verifying k drafts a request

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.query_len


@dataclass
class PreparedBatch:
    requests: list[ScheduledRequest]  # in batch order
    input_ids: torch.Tensor  # [num_tokens]
    ctx: ForwardContext
    logits_indices: torch.Tensor  # [num_sampled_rows] rows of the hidden states to sample from
    sampling_requests: list[int]  # batch indices of requests that sample, one row each
    num_logits_per_request: list[int]  # rows in logits_indices per sampling request (1 + drafts)
    # The real requests' rows (input_ids and ctx may hold padding requests after them; in a
    # padded verification step, a request with fewer drafts than k has dummy rows of its own).
    num_tokens: int = 0
    padded: StepShape | None = None  # a padded (captured) step's shape, padding included
    # (row of input_ids, batch index) of each decode whose input token is the last step's
    # sample, not read back yet (async scheduling): its row holds 0 until the runner copies
    # the token in on the device.
    unread_inputs: list[tuple[int, int]] = field(default_factory=list)


class StagedBuffer:
    """One persistent int64 input: a host staging tensor written in place (through `np`, a
    numpy view of it; pinned memory on CUDA) and the device tensor the step reads, at a fixed
    address (a captured graph reads it there). On CPU both are the same memory."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(
            shape, dtype=torch.int64, pin_memory=on_cuda and torch.cuda.is_available()
        )
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=torch.int64, device=device) if on_cuda else self.host

    def to_device(self, rows: int, cols: int | None = None) -> torch.Tensor:
        """The device tensor's first `rows` (by `cols`), copied from the host if they differ.
        Whole rows are copied: a contiguous pinned source, so the copy stays asynchronous (a
        column slice would go through pageable memory and wait)."""
        if self.device is not self.host:
            self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device[:rows] if cols is None else self.device[:rows, :cols]


class InputBuffers:
    """The persistent inputs of a step, sized for the largest one (max_num_tokens tokens,
    max_num_reqs requests): written in place every step, never reallocated.

    Host-side writes go to the numpy views (`input_ids`, `positions`, `slot_mapping`,
    `logits_indices` [max_num_tokens]; `block_table` [max_num_reqs, max_blocks_per_req];
    `seq_lens`, `state_rows` [max_num_reqs]; `query_start_loc` [max_num_reqs + 1]);
    `device_view` returns the device tensor of the rows a step uses. On CUDA the host copies are
    pinned and copied asynchronously; `wait_for_copies` (called before the host buffers are
    written again) makes sure the last step's copies have read them.

    A hybrid KV cache (`kv_groups`, core/kv/hybrid.py) adds `block_table_<g>` and
    `slot_mapping_<g>` for each group g >= 1 (group 0 uses the plain ones).
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        kv_groups: KVGroupLayout | None = None,
        recurrent_layers: tuple[int, ...] = (),
    ) -> None:
        self.device = device
        self.recurrent_layers = frozenset(recurrent_layers)
        num_groups = 1 if kv_groups is None else len(kv_groups.groups)
        self.num_groups = num_groups
        self.layer_groups: tuple[int, ...] = ()
        if kv_groups is not None:  # a layer holding no K/V (a recurrent one) reads no group's
            groups = map(kv_groups.group_of, range(kv_groups.num_layers))
            self.layer_groups = tuple(-1 if g is None else g for g in groups)
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.staged = {
            name: StagedBuffer((max_num_tokens,), device)
            for name in ("input_ids", "positions", "slot_mapping", "logits_indices")
        }
        self.staged["block_table"] = StagedBuffer((max_num_reqs, max_blocks_per_req), device)
        self.staged["seq_lens"] = StagedBuffer((max_num_reqs,), device)
        self.staged["query_start_loc"] = StagedBuffer((max_num_reqs + 1,), device)
        # Unread input tokens (PreparedBatch.unread_inputs): rows of input_ids, then the rows
        # of the last step's sampled ids they come from.
        self.staged["unread_inputs"] = StagedBuffer((2, max_num_reqs), device)
        # Each request's row of the recurrent layers' state pools (worker/state_pool.py).
        self.staged["state_rows"] = StagedBuffer((max_num_reqs,), device)
        for group in range(1, num_groups):
            self.staged[self.group_name("slot_mapping", group)] = StagedBuffer(
                (max_num_tokens,), device
            )
            self.staged[self.group_name("block_table", group)] = StagedBuffer(
                (max_num_reqs, max_blocks_per_req), device
            )
        self.input_ids = self.staged["input_ids"].np
        self.positions = self.staged["positions"].np
        self.slot_mapping = self.staged["slot_mapping"].np
        self.logits_indices = self.staged["logits_indices"].np
        self.block_table = self.staged["block_table"].np
        self.seq_lens = self.staged["seq_lens"].np
        self.query_start_loc = self.staged["query_start_loc"].np
        self.state_rows = self.staged["state_rows"].np
        # Recorded after each copy (the last record is the one waited for); one event, reused.
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None
        self._copies_pending = False

    @staticmethod
    def group_name(name: str, group: int) -> str:
        """The buffer `name` ("slot_mapping" or "block_table") of KV group `group`."""
        return name if group == 0 else f"{name}_{group}"

    def device_view(self, name: str, rows: int, cols: int | None = None) -> torch.Tensor:
        view = self.staged[name].to_device(rows, cols)
        if self._copies_done is not None:
            self._copies_done.record()
            self._copies_pending = True
        return view

    def wait_for_copies(self) -> None:
        """Before writing the host buffers: the previous step's copies out of them are done."""
        if self._copies_pending:
            self._copies_done.synchronize()
            self._copies_pending = False


def prepare_batch(
    requests: list[ScheduledRequest],
    buffers: InputBuffers,
    block_size: int,
    kv_caches: list[torch.Tensor],
    padded: StepShape | None = None,
) -> PreparedBatch:
    """The step's inputs in `buffers`. With `padded` (a captured step), every request spans
    padded.query_len rows: its own tokens, then dummy rows (a verification of fewer drafts than
    k: token 0 at position 0, written to slot 0 of the null block, never sampled; its seq_len
    counts them, so its own tokens keep their causal ends). Padding requests fill the rows up to
    padded.num_reqs: query_len tokens 0 at positions 0.. in slot 0 of the null block, seq_len
    query_len, a block table of zeros. Tables are then passed at their full width, so every
    shape depends on `padded` alone."""
    buffers.wait_for_copies()
    # Stable: decodes first; within each part, requests of one LoRA adapter side by side (its
    # rows a slice: model/lora.py).
    requests = sorted(requests, key=lambda r: (not r.is_decode, r.state.lora_id))
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    sampling_requests: list[int] = []
    num_logits: list[int] = []
    max_blocks = [1] * buffers.num_groups
    unread_inputs: list[tuple[int, int]] = []
    for i, req in enumerate(requests):
        start, stop = query_start_loc[-1], query_start_loc[-1] + req.num_new_tokens
        if not _fill_request(req, buffers, block_size, start, stop, i):
            unread_inputs.append((start, i))
        end = stop
        if padded is not None:
            if req.num_new_tokens > padded.query_len:
                raise ValueError(
                    f"a request of {req.num_new_tokens} query tokens cannot be padded to "
                    f"the captured shape {padded}"
                )
            end = start + padded.query_len
            _null_rows(buffers, slice(stop, end))  # its dummy rows, after its own tokens
        query_start_loc.append(end)
        seq_lens.append(req.state.num_computed_tokens + end - start)
        if buffers.recurrent_layers:
            buffers.state_rows[i] = req.state.state_row
        for group, block_ids in enumerate(_tables(req.state)):
            max_blocks[group] = max(max_blocks[group], len(block_ids))
        if req.samples:
            # Verify drafts: logits at the last 1 + k positions; else only at the last one.
            rows = 1 + len(req.draft_token_ids)
            logits_rows.extend(range(stop - rows, stop))
            sampling_requests.append(i)
            num_logits.append(rows)
    num_tokens, num_reqs = query_start_loc[-1], len(requests)
    real_tokens, table_widths = num_tokens, max_blocks
    num_decodes = sum(1 for r in requests if r.is_decode)
    if padded is not None:
        _fill_padding(buffers, num_reqs, padded, query_start_loc, seq_lens)
        # Every request spans query_len rows now: all of them decodes, or none.
        num_decodes = padded.num_reqs if padded.query_len == 1 else 0
        num_tokens, num_reqs = padded.num_tokens, padded.num_reqs
        table_widths = [buffers.block_table.shape[1]] * buffers.num_groups
    buffers.seq_lens[:num_reqs] = seq_lens
    buffers.query_start_loc[: num_reqs + 1] = query_start_loc
    buffers.logits_indices[: len(logits_rows)] = logits_rows
    view = buffers.device_view
    ctx = ForwardContext(
        positions=view("positions", num_tokens),
        slot_mapping=view("slot_mapping", num_tokens),
        kv_caches=kv_caches,
        block_size=block_size,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        seq_lens_t=view("seq_lens", num_reqs),
        block_tables=view("block_table", num_reqs, table_widths[0]),
        num_decodes=num_decodes,
        query_start_loc_t=view("query_start_loc", num_reqs + 1),
        kv_groups=[
            KVGroupInputs(
                view(buffers.group_name("slot_mapping", group), num_tokens),
                view(buffers.group_name("block_table", group), num_reqs, table_widths[group]),
            )
            for group in range(1, buffers.num_groups)
        ],
        layer_groups=buffers.layer_groups,
        recurrent_layers=buffers.recurrent_layers,
        state_rows=view("state_rows", num_reqs) if buffers.recurrent_layers else None,
    )
    return PreparedBatch(
        requests=requests,
        input_ids=view("input_ids", num_tokens),
        ctx=ctx,
        logits_indices=view("logits_indices", len(logits_rows)),
        sampling_requests=sampling_requests,
        num_logits_per_request=num_logits,
        num_tokens=real_tokens,
        padded=padded,
        unread_inputs=unread_inputs,
    )


def _fill_padding(
    buffers: InputBuffers,
    num_reqs: int,
    shape: StepShape,
    query_start_loc: list[int],
    seq_lens: list[int],
) -> None:
    """Requests [num_reqs, shape.num_reqs): shape.query_len padding tokens each, in every KV
    group's slots and tables. Its tokens sit at positions 0.. and its table is zeros: each
    writes slot 0 and reads only the null block."""
    q = shape.query_len
    if shape.num_reqs < num_reqs:
        raise ValueError(f"{shape} is below the batch's {num_reqs} requests")
    rows = slice(num_reqs * q, shape.num_tokens)  # tokens
    _null_rows(buffers, rows)
    buffers.positions[rows] = np.tile(np.arange(q), shape.num_reqs - num_reqs)
    for group in range(buffers.num_groups):  # tables of zeros: the null block
        buffers.staged[buffers.group_name("block_table", group)].np[num_reqs : shape.num_reqs] = 0
    query_start_loc.extend(range((num_reqs + 1) * q, shape.num_tokens + 1, q))
    seq_lens.extend([q] * (shape.num_reqs - num_reqs))


def _null_rows(buffers: InputBuffers, rows: slice) -> None:
    """Rows no request reads back: token 0 at position 0, written to slot 0 (the null block)
    in every KV group."""
    buffers.input_ids[rows] = 0
    buffers.positions[rows] = 0
    for group in range(buffers.num_groups):
        buffers.staged[buffers.group_name("slot_mapping", group)].np[rows] = 0


def _tables(state: CachedRequestState) -> list[list[int]]:
    """The request's block table of each KV group."""
    return [state.block_ids, *state.group_block_ids]


def _fill_request(
    req: ScheduledRequest, buffers: InputBuffers, block_size: int, start: int, stop: int, row: int
) -> bool:
    """Its rows and block tables; False when it is a decode whose input token is not read
    back yet (its row holds 0)."""
    state = req.state
    first = state.num_computed_tokens
    tables = _tables(state)
    for group, ids in enumerate(tables):
        buffers.staged[buffers.group_name("block_table", group)].np[row, : len(ids)] = ids
    if req.is_decode:  # the common case, without numpy temporaries
        known = first < state.num_tokens
        buffers.input_ids[start] = state.token_ids[first] if known else 0
        buffers.positions[start] = first
        for group, ids in enumerate(tables):
            slots = buffers.staged[buffers.group_name("slot_mapping", group)].np
            slots[start] = ids[first // block_size] * block_size + first % block_size
        return known
    # Known tokens first; positions past them are this step's draft tokens.
    known = state.token_ids[first : first + req.num_new_tokens]
    tokens = known + req.draft_token_ids[: req.num_new_tokens - len(known)]
    positions = np.arange(first, first + req.num_new_tokens, dtype=np.int64)
    buffers.input_ids[start:stop] = tokens
    buffers.positions[start:stop] = positions
    for group, ids in enumerate(tables):
        blocks = np.asarray(ids, dtype=np.int64)
        slots = buffers.staged[buffers.group_name("slot_mapping", group)].np
        # slot = block_id * block_size + offset within the block
        slots[start:stop] = blocks[positions // block_size] * block_size + positions % block_size
    return True
