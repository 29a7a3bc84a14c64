"""The scheduler → worker seam (L1).

Full data only for requests new to the worker's batch (first scheduling, or resumed after a
preemption, since the worker dropped them); only changes for the rest, so that the output is
cheap to send to another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbus.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]  # appended to the request's block table
    num_computed_tokens: int  # tokens already in the KV cache before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id → tokens to compute this step; insertion order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id → draft tokens to verify this step (spec decode); their slots are allocated.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the worker must forget: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output: req_id → rows in grammar_bitmask (1 + drafts rows per request).
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: object | None = None  # numpy int32 [rows, ceil(vocab / 32)]
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
