"""Beam search over the engine, as vLLM's OpenAI server runs it (L5).

`use_beam_search` keeps `n` beams. Each step asks the engine for one token of every live beam
(prompt + the beam's tokens, greedy, with the top 2n logprobs), so that every beam has 2n
candidate continuations; the n best candidates by score stay live:

    score = cumulative logprob / (generated tokens ** length_penalty)    (EOS not counted)

A candidate that ends (EOS unless ignore_eos, a stop token id, a stop string) leaves the live
set for the finished one; at max_tokens the live beams finish with "length". The answer is the
n best of all, by the same score. The engine runs each step as ordinary requests, so the
prefix cache serves every beam's prompt and shared history; nothing engine-side knows beams.

The search is deterministic: it ranks by the model's log-probabilities, which the engine
reports before temperature, penalties or any other sampling setting apply. Those settings
would be silently lost, so a request that combines them with beam search is a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from tokenbus.api.openai.protocol import ChatCompletionRequest, SamplingFields
from tokenbus.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams

# Request fields beam search cannot honour, with the values that ask for nothing.
INCOMPATIBLE_FIELDS: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "seed": (None,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "prompt_logprobs": (None,),
    "kv_transfer_params": (None,),
    "tools": (None, []),
    "functions": (None, []),
}


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    length_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def beam_search_params(
    req: SamplingFields, params: SamplingParams, max_logprobs: int
) -> BeamSearchParams:
    """The search `req` asks for (`params`: its validated sampling parameters, n = beam width);
    a ValueError naming the first field beam search cannot honour."""
    for name, no_op in INCOMPATIBLE_FIELDS.items():
        if name in type(req).model_fields and getattr(req, name) not in no_op:
            raise ValueError(f"{name}: cannot be combined with use_beam_search")
    if req.temperature not in (None, 0.0):
        raise ValueError(
            "temperature: beam search is deterministic; leave temperature out or set it to 0"
        )
    if req.response_format is not None and req.response_format.type != "text":
        raise ValueError("response_format: cannot be combined with use_beam_search")
    if req.best_of not in (None, req.n):
        raise ValueError("best_of: cannot be combined with use_beam_search (n is the beam width)")
    if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "none"):
        raise ValueError("tool_choice: cannot be combined with use_beam_search")
    if max_logprobs != -1 and 2 * req.n > max_logprobs:
        raise ValueError(
            f"n: beam search weighs 2n candidates per beam, and 2 × {req.n} is more than the "
            f"logprobs the server returns ({max_logprobs}, --max-logprobs)"
        )
    return BeamSearchParams(
        beam_width=req.n,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        length_penalty=req.length_penalty,
        stop=tuple(params.stop),
        stop_token_ids=frozenset(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
    )


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)  # generated so far
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # set when a stop string ended it (cut there)

    def score(self, eos_token_id: int | None, length_penalty: float) -> float:
        length = len(self.token_ids)
        if length and self.token_ids[-1] == eos_token_id:
            length -= 1
        return self.cumulative_logprob / max(length, 1) ** length_penalty


async def beam_search(
    engine: Any, request: EngineRequest, params: BeamSearchParams, prompt: str | None
) -> AsyncIterator[RequestOutput]:
    """One RequestOutput, when the search is done, with the `beam_width` best beams as its
    choices. `request` carries the prompt (and cache salt, priority) every step reuses.

    Cancelling the caller cancels the step in flight, whose engine requests abort."""
    search = _Search(engine, request, params)
    beams = [Beam()]
    num_cached_tokens = 0
    for step in range(params.max_tokens):
        async with asyncio.TaskGroup() as group:  # one failure cancels the step's others
            tasks = [
                group.create_task(search.next_token(f"{request.request_id}-beam{step}-{i}", beam))
                for i, beam in enumerate(beams)
            ]
        if step == 0:
            num_cached_tokens = tasks[0].result()[1]
        positions = [task.result()[0] for task in tasks]
        beams = search.advance(beams, positions, is_last=step + 1 == params.max_tokens)
        if not beams:
            break
    best = sorted(search.finished, key=search.score, reverse=True)[: params.beam_width]
    yield RequestOutput(
        request.request_id,
        prompt,
        request.prompt_token_ids,
        [search.output(i, beam) for i, beam in enumerate(best)],
        finished=True,
        num_cached_tokens=num_cached_tokens,
    )


Fate = Literal["live", "finished", "dropped"]


class _Search:
    def __init__(self, engine: Any, request: EngineRequest, params: BeamSearchParams) -> None:
        self.engine = engine
        self.request = request
        self.params = params
        self.eos_token_id = request.eos_token_id
        self.finished: list[Beam] = []
        # One greedy token with the top 2n logprobs: every beam's 2n candidates.
        self.step_params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=2 * params.beam_width,
            ignore_eos=True,
            skip_special_tokens=params.skip_special_tokens,
        )

    def score(self, beam: Beam) -> float:
        return beam.score(self.eos_token_id, self.params.length_penalty)

    async def next_token(self, request_id: str, beam: Beam) -> tuple[dict[int, Logprob], int]:
        """The candidates after `beam` (token id → logprob) and the prompt tokens the prefix
        cache served."""
        step = msgspec.structs.replace(
            self.request,
            request_id=request_id,
            prompt_token_ids=self.request.prompt_token_ids + beam.token_ids,
            sampling_params=self.step_params,
        )
        position: dict[int, Logprob] = {}
        num_cached = 0
        async with aclosing(self.engine.generate_request(step)) as outputs:
            async for out in outputs:
                num_cached = out.num_cached_tokens
                for output in out.outputs:
                    if output.logprobs:
                        position = output.logprobs[-1]
        return position, num_cached

    def advance(
        self, beams: list[Beam], positions: list[dict[int, Logprob]], is_last: bool
    ) -> list[Beam]:
        """The live beams after one step; candidates that end join `finished`."""
        live: list[Beam] = []
        for beam, position in zip(beams, positions):
            for token_id, logprob in position.items():
                candidate = Beam(
                    beam.token_ids + [token_id], beam.cumulative_logprob + logprob.logprob
                )
                fate = self._fate(candidate)
                if fate == "finished":
                    self.finished.append(candidate)
                elif fate == "live":
                    live.append(candidate)
        live = sorted(live, key=self.score, reverse=True)[: self.params.beam_width]
        if not is_last:
            return live
        for beam in live:
            beam.finish_reason = "length"
        self.finished.extend(live)
        return []

    def _fate(self, beam: Beam) -> Fate:
        """Whether `beam`'s last token ends it (its finish reason then set), keeps it live, or
        cannot occur: min_tokens masks EOS and stop tokens, as in sampling."""
        params = self.params
        token_id = beam.token_ids[-1]
        is_eos = token_id == self.eos_token_id and not params.ignore_eos
        num_before = len(beam.token_ids) - 1  # tokens generated before this one
        if is_eos or token_id in params.stop_token_ids:
            if num_before < params.min_tokens:
                return "dropped"
            beam.finish_reason, beam.stop_reason = "stop", None if is_eos else token_id
            return "finished"
        if not params.stop or len(beam.token_ids) < params.min_tokens:
            return "live"
        text = self.decode(beam.token_ids)
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if params.include_stop_str_in_output else at
                beam.text, beam.finish_reason, beam.stop_reason = text[:end], "stop", stop
                return "finished"
        return "live"

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(
            token_ids, skip_special_tokens=self.params.skip_special_tokens
        )

    def output(self, index: int, beam: Beam) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=beam.text if beam.text is not None else self.decode(beam.token_ids),
            token_ids=beam.token_ids,
            cumulative_logprob=beam.cumulative_logprob,
            finish_reason=beam.finish_reason,
            stop_reason=beam.stop_reason,
        )
