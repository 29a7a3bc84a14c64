"""POST /v1/chat/completions (L5).

Stream order per request, as OpenAI and vLLM send it: a `delta.role` chunk for every choice,
content deltas, the finish reason on each choice's last content chunk, an optional usage chunk
with `choices: []`, then `data: [DONE]`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.beam_search import BeamSearchParams, beam_search, beam_search_params
from tokenbus.api.openai.errors import error_event_body
from tokenbus.api.openai.logprobs import chat_logprobs, prompt_logprobs_body
from tokenbus.api.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from tokenbus.api.openai.reasoning_parsers import ReasoningPlan
from tokenbus.api.openai.reply_stream import ReplyStream
from tokenbus.api.openai.request_params import (
    chat_params,
    check_n,
    check_spec_size,
    make_usage,
    num_samples,
    truncate_prompt,
)
from tokenbus.api.openai.serving_engine import OpenAIServing
from tokenbus.api.openai.streaming import DONE_EVENT, sse_event
from tokenbus.api.openai.tool_stream import tool_finish_reason
from tokenbus.api.openai.tools import (
    ToolPlan,
    messages_for_template,
    new_call_id,
    plan_tools,
    template_supports_tools,
)
from tokenbus.engine.outputs import CompletionOutput
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams, StructuredOutputsParams

ASSISTANT = "assistant"
# Roles whose `content` may be null or absent (OpenAI: an assistant turn with only tool calls).
CONTENT_OPTIONAL_ROLES = frozenset({ASSISTANT, "tool", "function"})
# apply_chat_template arguments a request must not set through chat_template_kwargs: they change
# what the call returns or does (tokenize=True on a huge input blocks the event loop).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass
class ChatRun:
    engine_request: EngineRequest  # built (and so checked) by the input processor
    request: ChatCompletionRequest
    model: str
    prompt_text: str | None  # None once truncate_prompt_tokens cut the rendered prompt
    echo_text: str = ""  # `echo`: the last (assistant) message's content, before each reply
    tools: ToolPlan | None = None
    reasoning: ReasoningPlan | None = None  # --reasoning-parser
    created: int = field(default_factory=lambda: int(time.time()))
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served, from the outputs
    prompt_logprobs: list | None = None  # from the outputs, when asked for
    kv_transfer_params: dict | None = None  # from the final output, when a KV connector set them
    with_cache_details: bool = False  # --enable-prompt-tokens-details
    as_token_ids: bool = False  # return_tokens_as_token_ids
    beam: BeamSearchParams | None = None  # use_beam_search

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def num_samples(self) -> int:
        """Sequences sampled: best_of, else n (the beam width for beam search)."""
        return self.params.n

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.engine_request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        """As the engine runs them (logprobs -1 spelled out)."""
        return self.engine_request.sampling_params

    def usage(self, num_completion_tokens: int) -> UsageInfo:
        cached = [self.num_cached_tokens] if self.with_cache_details else None
        return make_usage([len(self.prompt_token_ids)], cached, num_completion_tokens)


class RenderedChat(NamedTuple):
    messages: list[dict[str, Any]]  # normalized: each content a string
    plan: ToolPlan | None
    text: str
    token_ids: list[int]


@dataclass
class ChatChoiceState:
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # when the engine computed logprobs

    def mean_logprob(self) -> float:
        if self.cumulative_logprob is None or not self.num_tokens:
            return float("-inf")
        return self.cumulative_logprob / self.num_tokens


class ChatServing(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.preflight(request, request.model)
        self.check_messages(request.messages, request.tools, request.functions)
        check_n(request, self.ctx.limits.caps)
        samples = num_samples(request, self.ctx.limits.caps)
        self.ctx.admission.check_room(samples)  # overloaded: refuse before preparing
        run = await self.prepare(self.build_run, request, raw=raw)
        self.log_user(run.request_id, request.user)
        budget = self.generation_budget([run.engine_request])
        return await self.respond(raw, request.stream, samples, run, budget)

    def render(self, request: ChatCompletionRequest) -> RenderedChat:
        """The chat as the model's template renders it, tools planned and checked."""
        if request.continue_final_message and request.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt "
                "(set add_generation_prompt to false)"
            )
        messages = [normalize_message(m, i) for i, m in enumerate(request.messages)]
        plan = plan_tools(request, self.ctx.tool_parser)
        native_tools = template_supports_tools(
            getattr(self.engine.tokenizer, "chat_template", None)
        )
        if plan is not None:
            self._check_tool_schemas(plan)
        kwargs = template_kwargs(request.chat_template_kwargs) or {}
        # vLLM hands these to the template too (templates that do not know them ignore them).
        for name in ("documents", "reasoning_effort"):
            if getattr(request, name, None) is not None:
                kwargs[name] = getattr(request, name)
        text, token_ids = self.engine.input_processor.render_chat(
            messages_for_template(messages, plan, native_tools),
            request.add_generation_prompt,
            kwargs or None,
            continue_final_message=request.continue_final_message,
            tools=plan.tools if plan is not None and native_tools else None,
        )
        if request.add_special_tokens:  # BOS and the like on top of what the template adds
            token_ids = self.engine.tokenizer.encode(text, add_special_tokens=True)
        return RenderedChat(messages, plan, text, token_ids)

    def build_run(self, request: ChatCompletionRequest) -> ChatRun:
        messages, plan, text, token_ids = self.render(request)
        processor = self.engine.input_processor
        truncated = truncate_prompt(
            token_ids,
            request.truncate_prompt_tokens,
            self.ctx.limits.max_model_len,
            request.truncation_side,
        )
        params = chat_params(request, len(truncated), self.ctx.limits)
        if plan is not None and (constraint := plan.structured_outputs()) is not None:
            if params.structured_outputs is not None:
                raise ValueError(
                    "tool_choice: a required or named tool call cannot be combined with "
                    "response_format / structured_outputs"
                )
            check_spec_size(constraint, self.ctx.limits.caps)
            params = params.clone(structured_outputs=constraint)
        if plan is not None and plan.mode == "auto" and plan.parser.needs_special_tokens:
            params = params.clone(skip_special_tokens=False)  # its marker is a special token
        reasoning = self._plan_reasoning(
            request, truncated, text if truncated is token_ids else None
        )
        if reasoning is not None and reasoning.may_reason and params.structured_outputs:
            raise ValueError(_constrained_reasoning_error(request, plan))
        if reasoning is not None and reasoning.parser.needs_special_tokens:
            params = params.clone(skip_special_tokens=False)  # its tags are special tokens
        self.check_request_tokens((len(truncated) + params.max_tokens) * params.n)
        engine_request = processor.make_request(
            self.request_id_for("chatcmpl", request.request_id),
            truncated,
            params,
            cache_salt=request.cache_salt,
            priority=request.priority,
            lora_request=self.lora_for(request.model),
        )
        self.check_prompt_logprobs([(len(truncated), engine_request.sampling_params)])
        beam = None
        if request.use_beam_search:
            beam = beam_search_params(request, params, self.engine.config.model.max_logprobs)
        echo = (
            messages[-1]["content"]
            if request.echo and messages[-1].get("role") == ASSISTANT
            else ""
        )
        return ChatRun(
            engine_request,
            request,
            self.response_model_name(request.model),
            text if truncated is token_ids else None,
            echo_text=echo,
            with_cache_details=self.ctx.enable_prompt_tokens_details,
            tools=plan,
            reasoning=reasoning,
            as_token_ids=self.tokens_as_ids(request),
            beam=beam,
        )

    def _plan_reasoning(
        self, request: ChatCompletionRequest, token_ids: list[int], text: str | None
    ) -> ReasoningPlan | None:
        parser = self.ctx.reasoning_parser
        if parser is None:
            return None
        return ReasoningPlan(
            parser, parser.first_phase(token_ids, text, request.chat_template_kwargs)
        )

    def _check_tool_schemas(self, plan: ToolPlan) -> None:
        """Every tool's parameters compile as a JSON schema (a 400 naming the tool otherwise);
        compiled once per schema, then cached by the validator."""
        validator = self.engine.input_processor.structured_validator
        for index, schema in enumerate(plan.parameters.values()):
            spec = StructuredOutputsParams(json=schema)
            try:
                check_spec_size(spec, self.ctx.limits.caps)
                validator.validate(spec)
            except ValueError as exc:
                reason = str(exc).removeprefix("structured_outputs: ")
                raise ValueError(f"tools[{index}].function.parameters: {reason}") from None

    def generate(self, run: ChatRun) -> AsyncIterator:
        if run.beam is not None:
            return beam_search(self.engine, run.engine_request, run.beam, run.prompt_text)
        return self.engine.generate_request(run.engine_request, prompt=run.prompt_text)

    def _delta_logprobs(self, run: ChatRun, output: CompletionOutput) -> ChatLogprobs | None:
        # The engine computes logprobs for best_of alone too: shown only when asked for.
        if not run.request.logprobs or output.logprobs is None:
            return None
        return chat_logprobs(
            output.token_ids,
            output.logprobs,
            run.params.logprobs,
            self.decode_token,
            run.as_token_ids,
        )

    async def _complete(self, run: ChatRun) -> Response:
        states = {i: ChatChoiceState() for i in range(run.num_samples)}
        # Leaving early (a disconnect cancels us, or a failure) closes the engine stream,
        # and generate() aborts its request when closed; _stream relies on the same.
        async with aclosing(self.generate(run)) as outputs:
            async for out in outputs:
                run.num_cached_tokens = out.num_cached_tokens
                run.prompt_logprobs = out.prompt_logprobs or run.prompt_logprobs
                run.kv_transfer_params = out.kv_transfer_params or run.kv_transfer_params
                for output in out.outputs:
                    fold_choice(states[output.index], output, self._delta_logprobs(run, output))
        answered = [states[i] for i in sorted(states)]
        if run.num_samples > run.request.n:  # best_of: the n of highest mean token logprob
            answered = sorted(answered, key=ChatChoiceState.mean_logprob, reverse=True)
        choices = [self.final_choice(run, i, s) for i, s in enumerate(answered[: run.request.n])]
        body = ChatCompletionResponse(
            id=run.request_id,
            created=run.created,
            model=run.model,
            choices=choices,
            usage=run.usage(sum(s.num_tokens for s in states.values())),
            prompt_token_ids=run.prompt_token_ids if run.request.return_token_ids else None,
            kv_transfer_params=run.kv_transfer_params,
        )
        if run.prompt_logprobs is not None:
            body.prompt_logprobs = prompt_logprobs_body(run.prompt_logprobs)
        return Response(body.model_dump_json(), media_type="application/json")

    async def collect(self, run: ChatRun) -> ChatChoiceState:
        """The one choice of `run`, generated to its end (the endpoints built on chat)."""
        state = ChatChoiceState()
        async with aclosing(self.generate(run)) as outputs:
            async for out in outputs:
                run.num_cached_tokens = out.num_cached_tokens
                for output in out.outputs:
                    fold_choice(state, output, None)
        return state

    def final_choice(self, run: ChatRun, index: int, state: ChatChoiceState) -> ChatChoice:
        text, finish_reason = state.text, state.finish_reason
        message = ChatMessage(role=ASSISTANT, content=run.echo_text + text)
        if run.reasoning is not None:  # tools are parsed from the content alone
            reasoning, content = run.reasoning.split(text, state.token_ids)
            text = content or ""
            message.content = run.echo_text + text if run.echo_text or content else content
            message.reasoning = message.reasoning_content = reasoning
        if run.tools is not None:
            message.content, calls = run.tools.calls_from_text(text)
            functions = [FunctionCall(name=c.name, arguments=c.arguments) for c in calls]
            if run.tools.legacy and functions:  # OpenAI's legacy form: one call, no id
                message.function_call = functions[0]
            elif functions:
                message.tool_calls = [ToolCall(id=new_call_id(), function=f) for f in functions]
            if functions:
                finish_reason = tool_finish_reason(run.tools, finish_reason)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=state.logprobs,
            finish_reason=finish_reason,
            stop_reason=state.stop_reason,
            token_ids=state.token_ids if run.request.return_token_ids else None,
        )

    async def _stream(self, run: ChatRun) -> AsyncIterator[bytes]:
        num_tokens = 0
        is_first = True
        options = run.request.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options.continuous_usage_stats
        replies: dict[int, ReplyStream] = {}
        try:
            async with aclosing(self.generate(run)) as outputs:
                async for out in outputs:
                    run.num_cached_tokens = out.num_cached_tokens
                    if is_first:  # role chunks once the request is running, as vLLM does
                        for event in self._first_events(run, continuous_usage):
                            yield event
                        is_first = False
                    for output in out.outputs:
                        num_tokens += len(output.token_ids)
                        usage = run.usage(num_tokens) if continuous_usage else None
                        if output.index not in replies:
                            content_choice = functools.partial(self._content_choice, run)
                            replies[output.index] = ReplyStream(
                                run.reasoning, run.tools, content_choice
                            )
                        for choice in replies[output.index].feed(output):
                            yield _chunk_event(run, [choice], usage)
            if include_usage:
                yield _chunk_event(run, [], run.usage(num_tokens))
        except Exception as exc:
            yield sse_event(error_event_body(exc, self.ctx.known_params))
        yield DONE_EVENT

    def _first_events(self, run: ChatRun, continuous_usage: bool) -> list[bytes]:
        """Each choice's role chunk (the first also carrying the prompt's token ids when asked
        for), then the echoed message as each choice's first content; with continuous usage
        each carries the usage so far (no completion tokens yet), as vLLM sends it."""
        usage = run.usage(0) if continuous_usage else None
        events = []
        for i in range(run.request.n):
            chunk = _chunk(
                run,
                [
                    ChatStreamChoice(
                        index=i,
                        delta=DeltaMessage(role=ASSISTANT, content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                ],
            )
            if run.request.return_token_ids and i == 0:
                chunk.prompt_token_ids = run.prompt_token_ids
            if usage is not None:
                chunk.usage = usage
            events.append(sse_event(chunk, exclude_unset=True))
        if run.echo_text:
            events.extend(
                _chunk_event(
                    run,
                    [ChatStreamChoice(index=i, delta=DeltaMessage(content=run.echo_text))],
                    usage,
                )
                for i in range(run.request.n)
            )
        return events

    def _content_choice(self, run: ChatRun, output: CompletionOutput) -> ChatStreamChoice:
        delta = (
            DeltaMessage(content=output.text)
            if output.text or not output.finish_reason
            else DeltaMessage()
        )
        choice = ChatStreamChoice(
            index=output.index,
            delta=delta,
            logprobs=self._delta_logprobs(run, output),
            finish_reason=output.finish_reason,
        )
        if output.finish_reason:
            choice.stop_reason = output.stop_reason
        if run.request.return_token_ids:
            choice.token_ids = list(output.token_ids)
        return choice


def _chunk(run: ChatRun, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=run.request_id,
        object="chat.completion.chunk",
        created=run.created,
        model=run.model,
        choices=choices,
    )


def _chunk_event(
    run: ChatRun, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
) -> bytes:
    # Serialized with exclude_unset (as vLLM does): a delta carries only what it changes.
    chunk = _chunk(run, choices)
    if usage is not None:
        chunk.usage = usage
    return sse_event(chunk, exclude_unset=True)


def fold_choice(
    state: ChatChoiceState, output: CompletionOutput, logprobs: ChatLogprobs | None
) -> None:
    state.text += output.text
    state.num_tokens += len(output.token_ids)
    state.token_ids.extend(output.token_ids)
    if output.cumulative_logprob is not None:
        state.cumulative_logprob = output.cumulative_logprob
    if logprobs is not None:
        if state.logprobs is None:
            state.logprobs = ChatLogprobs(content=[])
        state.logprobs.content.extend(logprobs.content or [])
    if output.finish_reason:
        state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason


def normalize_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as chat templates expect it: `content` a string.

    OpenAI content parts ([{"type": "text", "text": …}]) become one string (other parts are
    refused); a null or absent content is "" where OpenAI allows it (an assistant message that
    only calls tools, a tool result) and a 400 where it does not.
    """
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"messages[{index}].role: required, and must be a string")
    message = _from_legacy(message, index)
    role = message["role"]
    calls = message.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list)
        and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
    ):
        raise ValueError(
            f'messages[{index}].tool_calls: expected [{{"id", "type": "function", '
            f'"function": {{"name", "arguments"}}}}, ...]'
        )
    content = message.get("content")
    if content is None:
        if role not in CONTENT_OPTIONAL_ROLES:
            raise ValueError(f"messages[{index}].content: required for role {role!r}")
        return {**message, "content": ""}
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content: must be a string or a list of text parts")
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ValueError(f"messages[{index}].content: only text parts are supported")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _from_legacy(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI's legacy history: an assistant's `function_call` becomes its one tool call, a
    `function` message (the call's result) a `tool` message, as templates know them."""
    if message["role"] == "function":
        message = {**message, "role": "tool"}
    call = message.get("function_call")
    if call is None or message.get("tool_calls") is not None:
        return message
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f'messages[{index}].function_call: expected {{"name", "arguments"}}')
    rest = {k: v for k, v in message.items() if k != "function_call"}
    return {**rest, "tool_calls": [{"id": f"call_{index}", "type": "function", "function": call}]}


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if not kwargs:
        return None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs: may not set {', '.join(reserved)}")
    return kwargs


def _constrained_reasoning_error(request: ChatCompletionRequest, plan: ToolPlan | None) -> str:
    """Structured output constrains the reply from its first token; vLLM's waits for the
    reasoning to end, ours cannot yet, so a reply that may reason is refused a constraint."""
    if plan is not None and plan.structured_outputs() is not None:
        field = "tool_choice"
    elif request.response_format is not None:
        field = "response_format"
    else:
        field = "structured_outputs"
    return (
        f"{field}: structured output constrains the reply from its first token, so it cannot "
        "follow a reasoning model's thinking (--reasoning-parser); turn thinking off for this "
        'request (qwen3: chat_template_kwargs {"enable_thinking": false})'
    )
