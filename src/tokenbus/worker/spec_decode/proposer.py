"""What every proposer shares: the interface, per-request draft caps, and the factory (L3).

A proposer runs at the end of a step, after the runner appended the step's tokens to its
request states, and returns the drafts to verify next step (ModelRunnerOutput.spec_token_ids).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tokenbus.config import EngineConfig
from tokenbus.model_arch import ModelArch
from tokenbus.worker.request_state import CachedRequestState

if TYPE_CHECKING:
    from tokenbus.worker.input_batch import PreparedBatch
    from tokenbus.worker.spec_decode.draft_model import DraftModel


class Proposer(Protocol):
    def propose(
        self, batch: PreparedBatch, sampled: list[bool], caps: list[int]
    ) -> list[list[int]]:
        """Drafts per request of `batch.requests` (same order), at most `caps[i]` for request i.

        Runs after the step's sampled tokens were appended to the request states; `sampled[i]`
        says whether request i sampled (False: a partial prefill chunk). A request with cap 0
        may still need work (a draft model keeps its own KV cache in step with the target's).
        """

    def capture_model(self, config: EngineConfig, device: torch.device) -> None:
        """Record the proposer's own forwards as the target's steps were (after they were
        captured: worker/captured_step.py); nothing for a proposer without a model."""


def draft_cap(
    state: CachedRequestState,
    k: int,
    max_model_len: int,
    stop_token_ids: list[int],
    emitted: list[int] | None,
) -> int:
    """How many drafts are worth proposing for a request: none unless it sampled this step
    (`emitted`: the tokens it got, already appended to `state`) and goes on; never more than
    its remaining max_tokens allow after the bonus token, nor past max_model_len - 1 positions
    (the scheduler computes no further)."""
    if not emitted:
        return 0
    params = state.sampling_params
    num_output = len(state.output_token_ids)
    if num_output >= params.min_tokens and any(t in stop_token_ids for t in emitted):
        return 0  # the request stops on one of these tokens
    cap = min(k, max_model_len - 1 - state.num_tokens)
    if params.max_tokens is not None:
        cap = min(cap, params.max_tokens - num_output - 1)
    return max(cap, 0)


def make_proposer(
    config: EngineConfig,
    arch: ModelArch,
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    draft: DraftModel | None = None,
) -> Proposer | None:
    """The proposer `config.speculative` asks for (None: no speculation); `draft`: a separate
    draft model, loaded with the target (spec_decode/draft_model.load_draft_model)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from tokenbus.worker.spec_decode.ngram import NgramProposer

        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    from tokenbus.worker.spec_decode.draft_model import make_draft_model_proposer

    return make_draft_model_proposer(config, arch, model, kv_caches, device, draft)
