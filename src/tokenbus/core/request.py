"""A request as the scheduler sees it (L1, no torch)."""

from __future__ import annotations

import enum
from collections.abc import Callable

from tokenbus.protocol import EngineRequest, FinishReason, LoRARequest
from tokenbus.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    # Every status after PREEMPTED is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


# Computes the hashes of the request's full blocks not hashed yet (set by the KV layer).
BlockHasher = Callable[["Request"], list[bytes]]


class Request:
    """Token state of one sequence.

    The scheduler's one rule: each step, give the request `num_new_tokens` so that
    `num_computed_tokens` catches up with `num_tokens_with_spec` (prompt + output + drafts).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        priority: int = 0,
        block_hasher: BlockHasher | None = None,
        lora_request: LoRARequest | None = None,
        lora_id: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.priority = priority
        # The adapter it runs with, and the engine's number for it (0: the base model).
        self.lora_request = lora_request
        self.lora_id = lora_id

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose ids are not back yet: at most one between a
        # step's schedule() and its update_from_output(), two while the next step is
        # scheduled before the last one's tokens are read (async scheduling).
        self.num_output_placeholders = 0
        # The scheduler's step index when it was added: a step scheduled before that never
        # ran it, whatever request of the same id it ran (set by Scheduler.add_request).
        self.first_step_index = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        # Set when it finishes, by the KV connector (kv_transfer/): sent with its last output.
        self.kv_transfer_params_out: dict | None = None
        self.kv_load_failed = False  # a connector load failed: compute everything from now on
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @classmethod
    def from_engine_request(
        cls, req: EngineRequest, block_hasher: BlockHasher | None = None, lora_id: int = 0
    ) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.cache_salt,
            req.priority,
            block_hasher,
            req.lora_request,
            lora_id,
        )

    @property
    def kv_transfer_params(self) -> dict | None:
        """What the client sent for the KV connector (SamplingParams.kv_transfer_params)."""
        return self.sampling_params.kv_transfer_params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
