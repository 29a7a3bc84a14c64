"""Speculative decoding figures (L1, plain Python): the scheduler counts one step with
`record`; the front end sums steps' SchedulerStats with `add`.

The scheduler reports per step: spec_num_drafts (requests that verified drafts),
spec_num_draft_tokens, spec_num_accepted_tokens and spec_accepted_per_pos (accepted drafts at
position j; its length is the longest draft of the step). Rates follow vLLM:
acceptance rate = accepted / drafted tokens; per-position rate j = accepted_per_pos[j] / drafts;
mean acceptance length = 1 + accepted / drafts (tokens a verifying request gains per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request verified `num_draft_tokens` drafts and accepted the first `num_accepted`."""
        self._add(
            1,
            num_draft_tokens,
            num_accepted,
            [1] * num_accepted + [0] * (num_draft_tokens - num_accepted),
        )

    def add(self, stats) -> None:
        """Add one step's SchedulerStats (None is ignored)."""
        if stats is None:
            return
        self._add(
            stats.spec_num_drafts,
            stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens,
            stats.spec_accepted_per_pos,
        )

    def merge(self, other: SpecDecodeMetrics) -> None:
        self._add(
            other.num_drafts,
            other.num_draft_tokens,
            other.num_accepted_tokens,
            other.accepted_per_pos,
        )

    def _add(
        self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int, per_pos: list[int]
    ) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
        for pos, count in enumerate(per_pos):
            self.accepted_per_pos[pos] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return (
            [count / self.num_drafts for count in self.accepted_per_pos] if self.num_drafts else []
        )

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "acceptance_rate_per_pos": [round(r, 4) for r in self.acceptance_rate_per_pos],
        }
