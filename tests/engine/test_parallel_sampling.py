"""n > 1 fan-out: child ids, seeds and prompt logprobs of the children of one checked request."""

from tokenbus.engine.parallel_sampling import fan_out
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams


def make_request(**params) -> EngineRequest:
    return EngineRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=4, **params),
        arrival_time=12.5,
        cache_salt="salt",
    )


def test_one_sequence_is_the_request_itself():
    request = make_request()
    assert fan_out(request) == [request]


def test_children_sample_independently_and_share_the_rest():
    children = fan_out(make_request(n=3, seed=7, prompt_logprobs=2))
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.n for c in children] == [1, 1, 1]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    # They share the prompt: only the first computes its logprobs.
    assert [c.sampling_params.prompt_logprobs for c in children] == [2, None, None]
    assert all(c.prompt_token_ids == [1, 2, 3] for c in children)
    assert {(c.arrival_time, c.cache_salt, c.sampling_params.max_tokens) for c in children} == {
        (12.5, "salt", 4)
    }


def test_unseeded_children_stay_unseeded():
    assert [c.sampling_params.seed for c in fan_out(make_request(n=2))] == [None, None]
