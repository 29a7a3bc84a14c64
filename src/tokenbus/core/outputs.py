"""The worker → scheduler seam (L1): a msgspec Struct, sent back by rank 0 of an executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from tokenbus.protocol import TokenLogprobs


class KVConnectorOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a KV connector's worker half reports after a step (see core/sched/ports.py)."""

    finished_sending: list[str] = []  # producer: requests whose blocks may be freed now
    # Consumer: requests whose asynchronous load ended, successful or not, aborted or not:
    # each load started is reported once (its blocks stay held until then).
    finished_recving: list[str] = []
    # Blocks whose load failed (their tokens are recomputed, or the request fails); for an
    # asynchronous load, in the same report as its finished_recving.
    invalid_block_ids: list[int] = []
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    # Connector-specific, for its scheduler half only (e.g. which block hashes a tier now holds).
    worker_meta: bytes | None = None

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.bytes_loaded
            or self.bytes_saved
            or self.worker_meta
        )


class ModelRunnerOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    req_ids: list[str]
    # Per request, the tokens sampled this step: empty for a partial prefill chunk, one token
    # normally, up to 1 + num_drafts with speculative decoding (accepted drafts + one more).
    sampled_token_ids: list[list[int]]
    # Aligned with sampled_token_ids when the request asked for logprobs, else None.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Embedding requests whose prefill ended this step: their pooled vector, aligned with req_ids.
    pooled: list[list[float] | None] | None = None
    # Prompt logprobs of the step's prefill chunk, aligned with req_ids (None: not asked for).
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs_start: list[int] | None = None  # the prompt position of each one's first entry
    # Draft proposals for the next step (spec decode), aligned with req_ids.
    spec_token_ids: list[list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    # Derived from req_ids (also after decoding: msgspec runs __post_init__ then).
    req_id_to_index: dict[str, int] = {}

    def __post_init__(self) -> None:
        if not self.req_id_to_index:
            self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_ids)}


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class PendingOutput(Protocol):
    """A step handed to the device whose output may still be on it: `result()` reads it back
    (waiting for the step) once, in launch order."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass(frozen=True)
class ReadyOutput:
    """A step whose output is on the host already (a step run to its end, or a fake's)."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output
