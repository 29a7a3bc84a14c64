"""POST /v1/completions (L5).

Several prompts run as separate engine requests; choice index = prompt index * n + child index,
as in OpenAI's API. Everything is validated before the engine sees any of them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.beam_search import BeamSearchParams, beam_search, beam_search_params
from tokenbus.api.openai.errors import error_event_body
from tokenbus.api.openai.logprobs import (
    completion_logprobs,
    merge_completion_logprobs,
    prompt_logprobs_body,
)
from tokenbus.api.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tokenbus.api.openai.request_params import (
    check_kv_transfer_params,
    check_n,
    completion_params,
    make_usage,
    num_samples,
    truncate_prompt,
)
from tokenbus.api.openai.serving_engine import OpenAIServing
from tokenbus.api.openai.streaming import DONE_EVENT, merge_async_iterators, sse_event
from tokenbus.engine.outputs import CompletionOutput, RequestOutput
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams


@dataclass
class PreparedPrompt:
    engine_request: EngineRequest  # built (and so checked) by the input processor
    text: str | None
    num_cached_tokens: int = 0  # from the engine's outputs
    prompt_logprobs: list | None = None  # from the engine's outputs, when asked for
    kv_transfer_params: dict | None = None  # from the final output, when a KV connector set them

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.engine_request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        """As the engine runs them (logprobs -1 spelled out)."""
        return self.engine_request.sampling_params


@dataclass
class ChoiceState:
    """One choice being assembled from delta outputs."""

    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    is_started: bool = False  # the echoed prompt goes before the first delta
    # echo + logprobs, when the choice started before its prompt's logprobs arrived (another
    # choice of the prompt computes them): they go in front once known (non-streamed only).
    echo_logprobs_pending: bool = False
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # when the engine computed logprobs

    def mean_logprob(self) -> float:
        if self.cumulative_logprob is None or not self.num_tokens:
            return float("-inf")
        return self.cumulative_logprob / self.num_tokens


@dataclass
class Delta:
    """One engine output, folded into its choice's state: what a stream chunk carries."""

    index: int  # the choice's: prompt index * n + child index
    prompt: PreparedPrompt
    output: CompletionOutput
    text: str  # with the echoed prompt before the choice's first delta
    logprobs: CompletionLogProbs | None
    is_first: bool  # the choice's first delta


@dataclass
class CompletionRun:
    """A validated request on its way through the engine."""

    request_id: str
    request: CompletionRequest
    model: str
    prompts: list[PreparedPrompt]
    created: int = field(default_factory=lambda: int(time.time()))
    with_cache_details: bool = False  # --enable-prompt-tokens-details
    as_token_ids: bool = False  # return_tokens_as_token_ids
    beam: BeamSearchParams | None = None  # use_beam_search

    @property
    def generates(self) -> bool:
        """False for echo with max_tokens 0: the engine's one token is left out."""
        return self.request.max_tokens != 0

    @property
    def with_logprobs(self) -> bool:
        """The response shows logprobs (the engine may compute some for best_of alone)."""
        return self.request.logprobs is not None

    @property
    def num_samples(self) -> int:
        """Sequences per prompt: best_of, else n (the beam width for beam search)."""
        return self.prompts[0].params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def choice_index(self, prompt_index: int, child_index: int) -> int:
        """The index a sample is kept under; with best_of > n the kept samples are numbered
        again (prompt index * n + rank) once chosen."""
        return prompt_index * self.num_samples + child_index

    def usage(self, num_completion_tokens: int) -> UsageInfo:
        cached = [p.num_cached_tokens for p in self.prompts] if self.with_cache_details else None
        return make_usage([len(p.token_ids) for p in self.prompts], cached, num_completion_tokens)


class CompletionServing(OpenAIServing):
    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        self.preflight(request, request.model)
        prompts = split_prompts(request.prompt)
        # The caps that need no tokenizing, before any is done: a request's fan-out (each
        # sequence queues like a request of its own) and its text.
        check_n(request, self.ctx.limits.caps)
        samples = num_samples(request, self.ctx.limits.caps)
        self.ctx.limits.caps.check(
            "max_sequences_per_request",
            len(prompts) * samples,
            "number of sequences (prompts × n, or × best_of)",
            "prompt",
        )
        self.check_text_length("prompt", sum(len(p) for p in prompts if isinstance(p, str)))
        if request.max_tokens == 0 and not request.echo:
            raise ValueError(
                "max_tokens: 0 is allowed only with echo (the prompt's logprobs, nothing generated)"
            )
        if request.stream and request.echo and request.logprobs is not None and request.n > 1:
            raise ValueError("echo: streaming echo with logprobs is supported for n = 1 only")
        check_kv_transfer_params(request, len(prompts))
        # Overloaded: refuse before preparing.
        self.ctx.admission.check_room(len(prompts) * samples)
        run = await self.prepare(self._prepare, request, prompts, raw=raw)
        self.log_user(run.request_id, request.user)
        budget = self.generation_budget([p.engine_request for p in run.prompts])
        return await self.respond(raw, request.stream, samples * len(run.prompts), run, budget)

    def _tokenize(
        self, request: CompletionRequest, prompt: str | list[int]
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt; text gets BOS and the like unless
        add_special_tokens is false."""
        processor = self.engine.input_processor
        if isinstance(prompt, str) and request.add_special_tokens is False:
            token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
            return processor.tokenize({"prompt": prompt, "prompt_token_ids": token_ids})
        return processor.tokenize(
            prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        )

    def _prepare(self, request: CompletionRequest, prompts: list[str | list[int]]) -> CompletionRun:
        base_id = self.request_id_for("cmpl", request.request_id)
        processor = self.engine.input_processor
        prepared = []
        # The parameters depend on a prompt only through its length (the max_tokens check):
        # built once per length, not once per prompt.
        params_for_length: dict[int, SamplingParams] = {}
        for i, prompt in enumerate(prompts):
            text, token_ids = self._tokenize(request, prompt)
            truncated = truncate_prompt(
                token_ids,
                request.truncate_prompt_tokens,
                self.ctx.limits.max_model_len,
                request.truncation_side,
            )
            if truncated is not token_ids:
                text, token_ids = None, truncated  # echo decodes what is left
            params = params_for_length.get(len(token_ids))
            if params is None:
                params = completion_params(request, len(token_ids), self.ctx.limits)
                params_for_length[len(token_ids)] = params
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            engine_request = processor.make_request(
                request_id,
                token_ids,
                params,
                cache_salt=request.cache_salt,
                priority=request.priority,
                lora_request=self.lora_for(request.model),
            )
            prepared.append(PreparedPrompt(engine_request, text))
        self.check_request_tokens(
            sum((len(p.token_ids) + p.params.max_tokens) * p.params.n for p in prepared)
        )
        self.check_prompt_logprobs([(len(p.token_ids), p.params) for p in prepared])
        beam = None
        if request.use_beam_search:
            beam = beam_search_params(
                request, prepared[0].params, self.engine.config.model.max_logprobs
            )
        return CompletionRun(
            base_id,
            request,
            self.response_model_name(request.model),
            prepared,
            with_cache_details=self.ctx.enable_prompt_tokens_details,
            as_token_ids=self.tokens_as_ids(request),
            beam=beam,
        )

    def _generators(self, run: CompletionRun) -> list[AsyncIterator[RequestOutput]]:
        if run.beam is not None:
            return [
                beam_search(self.engine, p.engine_request, run.beam, p.text) for p in run.prompts
            ]
        return [self.engine.generate_request(p.engine_request, prompt=p.text) for p in run.prompts]

    def _echo_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.engine.tokenizer.decode(prompt.token_ids)

    def _update(
        self,
        run: CompletionRun,
        state: ChoiceState,
        prompt: PreparedPrompt,
        output: CompletionOutput,
    ) -> tuple[str, CompletionLogProbs | None]:
        """Fold one delta into its choice (all but the logprobs, which only _complete keeps);
        return the delta's text and logprobs."""
        generated = output.text if run.generates else ""
        token_ids = list(output.token_ids) if run.generates else []
        text, logprobs = generated, None
        if run.request.echo and not state.is_started:
            text = self._echo_text(prompt) + generated
            if run.with_logprobs:
                logprobs = self._echo_logprobs(run, prompt, state)
        state.is_started = True
        if output.cumulative_logprob is not None:
            state.cumulative_logprob = output.cumulative_logprob
        if run.with_logprobs and output.logprobs is not None and token_ids:
            more = completion_logprobs(
                token_ids,
                output.logprobs,
                prompt.params.logprobs,
                len(state.text) + (len(text) - len(generated)),
                self.decode_token,
                run.as_token_ids,
            )
            logprobs = merge_completion_logprobs(logprobs, more)
        state.text += text
        state.num_tokens += len(token_ids)
        state.token_ids.extend(token_ids)
        state.finish_reason = output.finish_reason or state.finish_reason
        state.stop_reason = output.stop_reason if output.finish_reason else state.stop_reason
        return text, logprobs

    def _echo_logprobs(
        self, run: CompletionRun, prompt: PreparedPrompt, state: ChoiceState
    ) -> CompletionLogProbs | None:
        """The echoed prompt's tokens with their logprobs (the first one's null)."""
        if prompt.prompt_logprobs is None:
            state.echo_logprobs_pending = True
            return None
        return completion_logprobs(
            prompt.token_ids,
            prompt.prompt_logprobs,
            prompt.params.logprobs,
            0,
            self.decode_token,
            run.as_token_ids,
        )

    async def _deltas(
        self, run: CompletionRun, states: dict[int, ChoiceState]
    ) -> AsyncIterator[Delta]:
        """Every prompt's outputs in arrival order, each folded into its choice in `states`.

        Leaving early (a disconnect cancels the caller, or a failure) closes every engine stream,
        and generate() aborts its request when closed.
        """
        async with aclosing(merge_async_iterators(*self._generators(run))) as outputs:
            async for p_idx, out in outputs:
                prompt = run.prompts[p_idx]
                prompt.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt.prompt_logprobs = out.prompt_logprobs
                if out.kv_transfer_params is not None:
                    prompt.kv_transfer_params = out.kv_transfer_params
                for output in out.outputs:
                    index = run.choice_index(p_idx, output.index)
                    state = states.setdefault(index, ChoiceState())
                    is_first = not state.is_started
                    text, logprobs = self._update(run, state, prompt, output)
                    yield Delta(index, prompt, output, text, logprobs, is_first)

    async def _complete(self, run: CompletionRun) -> Response:
        states: dict[int, ChoiceState] = {}
        async with aclosing(self._deltas(run, states)) as deltas:
            async for delta in deltas:
                if delta.logprobs is not None:
                    # Each delta's logprobs are built fresh and used only here, so the first
                    # can become the choice's accumulator as it is.
                    state = states[delta.index]
                    state.logprobs = merge_completion_logprobs(state.logprobs, delta.logprobs)
        for i, state in states.items():
            if state.echo_logprobs_pending:
                echoed = self._echo_logprobs(run, run.prompts[i // run.num_samples], state)
                state.logprobs = (
                    merge_completion_logprobs(echoed, state.logprobs) if state.logprobs else echoed
                )
        choices = [self._final_choice(run, i, s) for i, s in self._answered(run, states)]
        body = CompletionResponse(
            id=run.request_id,
            created=run.created,
            model=run.model,
            choices=choices,
            usage=run.usage(_num_tokens(states)),
            kv_transfer_params=run.prompts[0].kv_transfer_params,
        )
        return Response(body.model_dump_json(), media_type="application/json")

    @staticmethod
    def _answered(
        run: CompletionRun, states: dict[int, ChoiceState]
    ) -> list[tuple[int, ChoiceState]]:
        """(choice index, state) of the choices the response holds: every sample, or with
        best_of > n the n of highest mean token logprob per prompt (OpenAI's "best")."""
        n, samples = run.request.n, run.num_samples
        if samples == n:
            return sorted(states.items())
        answered = []
        for p_idx in range(len(run.prompts)):
            mine = [states[k] for k in range(p_idx * samples, (p_idx + 1) * samples) if k in states]
            best = sorted(mine, key=ChoiceState.mean_logprob, reverse=True)[:n]
            answered.extend((p_idx * n + rank, state) for rank, state in enumerate(best))
        return answered

    def _final_choice(self, run: CompletionRun, index: int, state: ChoiceState) -> CompletionChoice:
        prompt = run.prompts[index // run.request.n]
        with_ids = run.request.return_token_ids
        choice = CompletionChoice(
            index=index,
            text=state.text,
            logprobs=state.logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            prompt_token_ids=prompt.token_ids if with_ids else None,
            token_ids=state.token_ids if with_ids else None,
        )
        if run.request.prompt_logprobs is not None and prompt.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_body(prompt.prompt_logprobs)
        return choice

    async def _stream(self, run: CompletionRun) -> AsyncIterator[bytes]:
        states: dict[int, ChoiceState] = {}
        options = run.request.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options.continuous_usage_stats
        try:
            async with aclosing(self._deltas(run, states)) as deltas:
                async for delta in deltas:
                    if delta.text or delta.output.token_ids or delta.output.finish_reason:
                        chunk = self._chunk(run, delta, states[delta.index])
                        if continuous_usage:
                            chunk.usage = run.usage(_num_tokens(states))
                        yield sse_event(chunk)
            if include_usage:
                yield sse_event(self._usage_chunk(run, states))
        except Exception as exc:
            yield sse_event(error_event_body(exc, self.ctx.known_params))
        yield DONE_EVENT

    def _chunk(self, run: CompletionRun, delta: Delta, state: ChoiceState) -> CompletionResponse:
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=delta.logprobs,
            finish_reason=delta.output.finish_reason,
            stop_reason=delta.output.stop_reason,
        )
        if run.request.return_token_ids:
            choice.token_ids = list(delta.output.token_ids) if run.generates else []
            if delta.is_first:
                choice.prompt_token_ids = delta.prompt.token_ids
        if (
            delta.is_first
            and run.request.prompt_logprobs is not None
            and delta.prompt.prompt_logprobs is not None
        ):
            choice.prompt_logprobs = prompt_logprobs_body(delta.prompt.prompt_logprobs)
        return CompletionResponse(
            id=run.request_id, created=run.created, model=run.model, choices=[choice]
        )

    def _usage_chunk(
        self, run: CompletionRun, states: dict[int, ChoiceState]
    ) -> CompletionResponse:
        return CompletionResponse(
            id=run.request_id,
            created=run.created,
            model=run.model,
            choices=[],
            usage=run.usage(_num_tokens(states)),
        )


def _num_tokens(states: dict[int, ChoiceState]) -> int:
    return sum(s.num_tokens for s in states.values())


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's prompt forms: text, a batch of texts, token ids, a batch of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt: must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
