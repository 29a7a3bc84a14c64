"""Beam search (`use_beam_search`) and `best_of`: the search's steps on hand-made candidates, and
both through the app against the fake engine (fast)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.api import fake_engine
from tests.api.fake_engine import CharTokenizer
from tests.api.test_openai_app import (  # noqa: F401
    assert_error,
    client,
    engine,
    make_client,
    sse_events,
)
from tokenbus.api.openai.beam_search import Beam, BeamSearchParams, _Search
from tokenbus.engine.outputs import Logprob
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams

EOS = 0
CHAT = [{"role": "user", "content": "hi"}]


def make_search(**params) -> _Search:
    request = EngineRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), eos_token_id=EOS
    )
    engine = SimpleNamespace(tokenizer=CharTokenizer())
    return _Search(
        engine, request, BeamSearchParams(**{"beam_width": 2, "max_tokens": 8, **params})
    )


def candidates(**logprobs: float) -> dict[int, Logprob]:
    """Token → logprob by the token's character ("eos" for the end of sequence)."""
    return {(EOS if c == "eos" else ord(c)): Logprob(lp) for c, lp in logprobs.items()}


def texts(beams: list[Beam]) -> list[str]:
    return ["".join(chr(t) for t in b.token_ids) for b in beams]


# --- the search's steps ------------------------------------------------------------------------


def test_the_best_candidates_of_all_beams_stay_live():
    search = make_search()
    live = search.advance([Beam()], [candidates(a=-0.1, b=-1.0, c=-2.0, d=-3.0)], is_last=False)
    assert texts(live) == ["a", "b"]
    # b's best continuation beats a's second: beams compete across their parents.
    positions = [candidates(a=-5.0, b=-6.0), candidates(a=-0.1, b=-0.2)]
    live = search.advance(live, positions, is_last=False)
    assert texts(live) == ["ba", "bb"]
    assert live[0].cumulative_logprob == pytest.approx(-1.1)


def test_eos_finishes_a_beam_but_not_before_min_tokens():
    search = make_search()
    live = search.advance([Beam()], [candidates(eos=-0.1, a=-1.0, b=-2.0)], is_last=False)
    assert texts(live) == ["a", "b"] and len(search.finished) == 1
    assert search.finished[0].finish_reason == "stop" and search.finished[0].stop_reason is None
    early = make_search(min_tokens=1)
    live = early.advance([Beam()], [candidates(eos=-0.1, a=-1.0, b=-2.0)], is_last=False)
    assert texts(live) == ["a", "b"] and early.finished == []  # masked, as sampling masks it
    ignoring = make_search(ignore_eos=True)
    live = ignoring.advance([Beam()], [candidates(eos=-0.1, a=-1.0)], is_last=False)
    assert len(live) == 2 and ignoring.finished == []


def test_stop_token_ids_and_stop_strings_finish_beams():
    search = make_search(stop_token_ids=frozenset({ord("z")}), stop=("bc",))
    live = search.advance([Beam()], [candidates(z=-0.1, a=-1.0, b=-2.0)], is_last=False)
    assert search.finished[0].stop_reason == ord("z")
    live = search.advance(live, [candidates(b=-0.1), candidates(c=-0.1)], is_last=False)
    stopped = search.finished[-1]
    assert stopped.stop_reason == "bc" and search.output(0, stopped).text == ""  # cut before it
    assert texts(live) == ["ab"]
    kept = make_search(stop=("b",), include_stop_str_in_output=True)
    kept.advance([Beam(token_ids=[ord("a")])], [candidates(b=-0.1)], is_last=False)
    assert kept.output(0, kept.finished[0]).text == "ab"


def test_the_last_step_finishes_live_beams_with_length():
    search = make_search()
    live = search.advance([Beam()], [candidates(a=-0.1, b=-1.0, c=-2.0)], is_last=True)
    assert live == [] and [b.finish_reason for b in search.finished] == ["length", "length"]


def test_length_penalty_weighs_the_score_by_length():
    long, short = Beam([1, 2, 3, 4], -2.0), Beam([1], -1.0)
    assert long.score(EOS, 1.0) > short.score(EOS, 1.0)  # -0.5 per token against -1.0
    assert long.score(EOS, 0.0) < short.score(EOS, 0.0)  # no penalty: the sum decides
    assert Beam([5, EOS], -1.0).score(EOS, 1.0) == -1.0  # EOS is not counted


# --- through the app ---------------------------------------------------------------------------


def test_completions_beam_search(client, engine):
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "use_beam_search": True, "temperature": 0}
    response = client.post("/v1/completions", json=body).json()
    first, second = response["choices"]
    assert first["text"] != second["text"] and first["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 6
    # Each step: one greedy token per live beam with the top 2n logprobs.
    steps = engine.requests[-2:]
    assert all(p.max_tokens == 1 and p.logprobs == 4 and p.n == 1 for _, _, p in steps)
    assert all(len(prompt) == len("hi") + 2 for _, prompt, _ in steps)
    again = client.post("/v1/completions", json=body).json()
    assert again["choices"] == response["choices"]  # deterministic
    batch = client.post("/v1/completions", json={**body, "prompt": ["hi", "hi"]}).json()["choices"]
    texts_ = [c["text"] for c in batch]
    assert texts_[0] == texts_[2] and texts_[1] == texts_[3] and texts_[0] != texts_[1]


def test_beam_search_streams_its_result(client):
    body = {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, "stream": True}
    events = sse_events(client.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]"
    assert sorted(e["choices"][0]["index"] for e in events[:-1]) == [0, 1]
    assert all(e["choices"][0]["finish_reason"] == "length" for e in events[:-1])


def test_chat_beam_search(client):
    body = {"messages": CHAT, "max_tokens": 2, "n": 2, "use_beam_search": True}
    choices = client.post("/v1/chat/completions", json=body).json()["choices"]
    assert (
        len(choices) == 2 and choices[0]["message"]["content"] != choices[1]["message"]["content"]
    )
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    assert [e["choices"][0]["delta"].get("role") for e in events[:2]] == ["assistant"] * 2
    content = [c["delta"].get("content") for e in events[2:] for c in e["choices"]]
    assert sorted(c for c in content if c) == sorted(c["message"]["content"] for c in choices)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_p": 0.5}, "top_p"),
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 1}, "logprobs"),
        ({"seed": 3}, "seed"),
        ({"logit_bias": {"97": 1}}, "logit_bias"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"n": 11}, "n"),  # 2 × 11 candidates: more logprobs than --max-logprobs (20)
        ({"best_of": 3}, "best_of"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(client, extra, param):
    body = {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
    assert_error(client.post("/v1/completions", json=body), 400, param)


# --- best_of ------------------------------------------------------------------------------------


def test_best_of_answers_with_the_highest_mean_logprob(client, engine, monkeypatch):
    body = {"prompt": "hi", "max_tokens": 4, "best_of": 3}
    response = client.post("/v1/completions", json=body).json()
    # Child i's tokens have logprob -0.1 (i + 1) in the fake: child 0 ("abcd") is best.
    assert [c["text"] for c in response["choices"]] == ["abcd"]
    assert response["choices"][0]["logprobs"] is None  # computed to rank, not asked for
    assert response["usage"]["completion_tokens"] == 12  # every sample was generated
    assert engine.requests[-1][2].n == 3 and engine.requests[-1][2].logprobs == 0

    original = fake_engine._logprobs
    monkeypatch.setattr(
        fake_engine, "_logprobs", lambda t, n, child=0: original(t, n, 2 - child)
    )  # now the last child is best
    two = client.post("/v1/completions", json={**body, "n": 2, "prompt": ["x", "y"]}).json()
    assert [(c["index"], c["text"]) for c in two["choices"]] == [
        (0, "cdef"),
        (1, "bcde"),
        (2, "cdef"),
        (3, "bcde"),
    ]
    chat = {"messages": CHAT, "max_tokens": 2, "best_of": 3, "logprobs": True}
    choices = client.post("/v1/chat/completions", json=chat).json()["choices"]
    assert [c["message"]["content"] for c in choices] == ["cd"] and choices[0]["logprobs"]


@pytest.mark.parametrize(
    "extra",
    [{"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}, {"best_of": 17}],
)
def test_best_of_limits(client, extra):
    body = {"prompt": "hi", "max_tokens": 1, **extra}
    assert_error(client.post("/v1/completions", json=body), 400, "best_of")


def test_best_of_equal_to_n_is_plain_sampling(client, engine):
    body = {"prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 2, "stream": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.requests[-1][2].logprobs is None
