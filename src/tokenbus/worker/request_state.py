"""What the worker remembers about each request in its batch (L3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenbus.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None  # per-request seed: reproducible in any batch
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    # Mean pooling (embedding requests): the hidden states summed over the chunks so far.
    pooled_sum: torch.Tensor | None = None
    lora_id: int = 0  # its LoRA adapter (0: none), read from lora_path the first time
    lora_path: str | None = None
    # KV groups 1.. of a hybrid KV cache: their block tables (block_ids: group 0's)
    group_block_ids: list[list[int]] = field(default_factory=list)
    # Its row of the recurrent layers' state pools (worker/state_pool.py); -1: none
    state_row: int = -1

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.token_ids.extend(token_ids)
