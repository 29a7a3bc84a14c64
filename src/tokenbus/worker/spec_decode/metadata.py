"""Where each request's draft tokens sit among one step's logits rows (L3).

A verifying request with k drafts owns k + 1 consecutive logits rows: row j holds the target's
logits after the known tokens and the first j drafts, so row j checks draft j (0-based) and
row k gives the bonus token when every draft is accepted. A request without drafts owns one
row (its plain sample). Rows are request-major in the order of the sampling requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus.worker.sampling_metadata import SamplingRow, to_device


@dataclass
class SpecDecodeMetadata:
    """B = sampling requests, D = draft tokens in all, R = B + D logits rows."""

    num_draft_tokens: list[int]  # [B] k_i (0 for a request without drafts)
    first_rows: list[int]  # [B] first logits row of each request
    draft_token_ids: torch.Tensor  # Long[D], request-major
    draft_rows: torch.Tensor  # Long[D] the logits row that checks each draft
    draft_req_index: torch.Tensor  # Long[D] the request of each draft
    draft_pos: torch.Tensor  # Long[D] position of each draft within its request (0..k_i - 1)
    # Long[B] each, on the device: first_rows, num_draft_tokens and draft_starts, so the
    # rejection sampler indexes with them without a host list crossing over in the step.
    first_rows_t: torch.Tensor
    num_draft_tokens_t: torch.Tensor
    draft_starts_t: torch.Tensor
    # Float[D, V]: the proposer's distribution q at each draft; None when drafts are proposed
    # deterministically (n-gram, greedy draft model): q is then one-hot on the draft.
    draft_probs: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def num_rows(self) -> int:
        return self.num_requests + sum(self.num_draft_tokens)

    @property
    def draft_starts(self) -> list[int]:
        """[B] index of each request's first draft in the flat (request-major) draft list:
        request i's rows start at first_rows[i] and each earlier request adds one bonus row."""
        return [first - i for i, first in enumerate(self.first_rows)]

    @property
    def max_num_draft_tokens(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @classmethod
    def build(
        cls,
        draft_token_ids: list[list[int]],
        device: torch.device | str = "cpu",
        draft_probs: torch.Tensor | None = None,
    ) -> SpecDecodeMetadata:
        """`draft_token_ids[i]`: the drafts of sampling request i (may be empty)."""
        num_drafts = [len(d) for d in draft_token_ids]
        first_rows, rows, req_index, pos = [], [], [], []
        row = 0
        for i, k in enumerate(num_drafts):
            first_rows.append(row)
            rows.extend(range(row, row + k))
            req_index.extend([i] * k)
            pos.extend(range(k))
            row += k + 1
        flat = [t for d in draft_token_ids for t in d]
        if draft_probs is not None and draft_probs.shape[0] != len(flat):
            raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows for {len(flat)} drafts")

        starts = [first - i for i, first in enumerate(first_rows)]  # as draft_starts
        # Every index list in one host tensor, so one copy takes them to the device (pinned,
        # without waiting on CUDA: sampling_metadata.to_device); the fields are its slices.
        parts = (flat, rows, req_index, pos, first_rows, num_drafts, starts)
        packed = to_device(
            torch.tensor([v for part in parts for v in part], dtype=torch.long), device
        )
        fields = packed.split([len(part) for part in parts])
        return cls(num_drafts, first_rows, *fields, draft_probs=draft_probs)


def expand_sampling_rows(
    rows: list[SamplingRow], draft_token_ids: list[list[int]]
) -> list[SamplingRow]:
    """One SamplingRow per logits row: position j of a request sees its drafts before j as
    output tokens, so penalties and min_tokens apply exactly as if those drafts had been
    sampled one step at a time."""
    expanded = []
    for row, drafts in zip(rows, draft_token_ids):
        expanded.append(row)
        for j in range(1, len(drafts) + 1):
            expanded.append(
                SamplingRow(
                    params=row.params,
                    prompt_token_ids=row.prompt_token_ids,
                    output_token_ids=row.output_token_ids + drafts[:j],
                    generator=row.generator,
                    stop_ids_for_min_tokens=row.stop_ids_for_min_tokens,
                )
            )
    return expanded
