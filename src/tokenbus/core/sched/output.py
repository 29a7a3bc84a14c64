"""The scheduler → worker seam (L1).

Full data only for requests new to the worker's batch (first scheduling, or resumed after a
preemption, since the worker dropped them); only changes for the rest, so that the output is
cheap to send to another process. msgspec Structs: an executor sends them to worker processes
as msgpack frames, never by pickle.
"""

from __future__ import annotations

import msgspec

from tokenbus.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Its LoRA adapter (0: none); the path lets a worker load one it has not seen yet.
    lora_id: int = 0
    lora_path: str | None = None
    # KV groups 1.. of a hybrid KV cache (core/kv/hybrid.py): their tables (block_ids: group 0)
    group_block_ids: list[list[int]] = msgspec.field(default_factory=list)


class CachedRequestData(msgspec.Struct, array_like=True):
    req_id: str
    new_block_ids: list[int]  # appended to the request's block table
    num_computed_tokens: int  # tokens already in the KV cache before this step
    # KV groups 1.. of a hybrid KV cache: what is appended to each of their tables
    new_group_block_ids: list[list[int]] = msgspec.field(default_factory=list)


class GrammarBitmask(msgspec.Struct, array_like=True):
    """An int32 [num_rows, num_words] array (one bit per token, row-major, native byte order)
    as raw bytes, so that it crosses a process boundary without pickle or a copy per row."""

    data: bytes
    num_rows: int
    num_words: int


class SchedulerOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id → tokens to compute this step; insertion order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id → draft tokens to verify this step (spec decode); their slots are allocated.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Requests the worker must forget: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = set()
    preempted_req_ids: set[str] = set()
    # Structured output: req_id → its first row in grammar_bitmask (1 + drafts rows each).
    structured_output_request_ids: dict[str, int] = {}
    grammar_bitmask: GrammarBitmask | None = None
    # Opaque to the scheduler: what a KV connector's scheduler half tells its worker half.
    kv_connector_metadata: bytes | None = None
    # The scheduler's count of steps before this one (async scheduling: a request added after
    # this step was scheduled is not in it, though it may reuse an id that is).
    step_index: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
