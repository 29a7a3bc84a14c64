"""How many drafts a request gets: none after a partial chunk or a stop token, never past
max_tokens (bonus token included) or max_model_len."""

from __future__ import annotations

from tokenbus.sampling_params import SamplingParams
from tokenbus.worker.request_state import CachedRequestState
from tokenbus.worker.spec_decode import draft_cap


def _state(num_prompt: int, output: list[int], **params) -> CachedRequestState:
    return CachedRequestState(
        "r",
        list(range(100, 100 + num_prompt)),
        list(output),
        SamplingParams(**params),
        block_ids=[],
        num_computed_tokens=0,
    )


def test_no_drafts_without_a_sample_or_after_a_stop_token():
    assert draft_cap(_state(10, [5]), 4, 1000, [2], emitted=None) == 0
    assert draft_cap(_state(10, [5]), 4, 1000, [2], emitted=[5]) == 4
    assert draft_cap(_state(10, [5, 2, 7]), 4, 1000, [2], emitted=[2, 7]) == 0
    # min_tokens not reached: the stop id does not stop the request.
    assert draft_cap(_state(10, [2], min_tokens=3), 4, 1000, [2], emitted=[2]) == 4


def test_capped_by_max_tokens_and_max_model_len():
    # 2 drafts + bonus = 5
    assert draft_cap(_state(10, [1, 1], max_tokens=5), 4, 1000, [], emitted=[1]) == 2
    assert draft_cap(_state(10, [1] * 4, max_tokens=5), 4, 1000, [], emitted=[1]) == 0
    # 11 known, feeds <= 12
    assert draft_cap(_state(10, [1], max_tokens=None), 4, 13, [], emitted=[1]) == 1
    assert draft_cap(_state(10, [1], max_tokens=None), 4, 12, [], emitted=[1]) == 0
