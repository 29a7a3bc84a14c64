"""N-gram prompt lookup: draft the tokens that followed the context's suffix last time (L3).

For a context t[0..L) the proposer looks for earlier occurrences of its suffix t[L-n..L) with
prompt_lookup_min <= n <= prompt_lookup_max and proposes the (up to) k tokens that followed the
longest one. Vectorised in numpy: the candidates are the earlier positions holding the last
token; each round extends every live candidate's match one token backwards, so a step costs
O(L + candidates * max_n) array work, not a Python scan per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from tokenbus.config import EngineConfig
    from tokenbus.worker.input_batch import PreparedBatch

_EMPTY = np.zeros(0, dtype=np.int64)


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Drafts (Int64[<= k]) following the longest matched suffix of `tokens`; empty if none.

    Among equally long matches the latest wins (the most recent context usually continues the
    same way). A continuation that runs past the end of the context continues with the drafts
    themselves (a copy of a copy), so a periodic context such as "a b a b" drafts "a b a b".
    """
    num_tokens = len(tokens)
    if k <= 0 or num_tokens <= min_n:
        return _EMPTY
    last = num_tokens - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # [C] where an earlier match would end
    if ends.size == 0:
        return _EMPTY
    match_len = np.ones(ends.size, dtype=np.int64)  # [C] suffix tokens matched so far
    alive = np.ones(ends.size, dtype=bool)  # [C] candidates still matching
    for j in range(1, min(max_n, last)):
        starts = ends - j
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[last - j]
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return _EMPTY
    end = int(ends[np.flatnonzero(match_len == best)[-1]])
    # Draft i copies position end + 1 + i; past the context that position is draft i - period.
    period = last - end
    copied = np.arange(end + 1, end + 1 + k) - num_tokens  # [k] < 0: inside the context
    source = np.where(copied < 0, copied, copied % period - period)  # [k] index from the end
    return tokens[num_tokens + source]


class NgramProposer:
    """Per-request prompt lookup over the whole context (prompt + output)."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(
        self, batch: PreparedBatch, sampled: list[bool], caps: list[int]
    ) -> list[list[int]]:
        """Drafts per request of the batch from its whole context (prompt + output so far)."""
        return self.propose_for_contexts([r.state.token_ids for r in batch.requests], caps)

    def capture_model(self, config: EngineConfig, device: torch.device) -> None:
        pass  # no forward of its own

    def propose_for_contexts(
        self, contexts: list[list[int]], max_num_drafts: list[int]
    ) -> list[list[int]]:
        """Drafts per context; `max_num_drafts[i]` caps context i (0: no drafts)."""
        drafts = []
        for context, cap in zip(contexts, max_num_drafts):
            k = min(self.k, cap)
            if k <= 0:
                drafts.append([])
                continue
            tokens = np.asarray(context, dtype=np.int64)
            drafts.append(ngram_propose(tokens, self.min_n, self.max_n, k).tolist())
        return drafts
