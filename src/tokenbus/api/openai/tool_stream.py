"""A chat choice's stream when tools are in play (L5): the model's text as OpenAI `tool_calls`
deltas (or, for a legacy `functions` request, `function_call` deltas), and the finish reason a
call gets."""

from __future__ import annotations

from tokenbus.api.openai.protocol import (
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from tokenbus.api.openai.tools import ToolPlan, new_call_id
from tokenbus.engine.outputs import CompletionOutput


def tool_finish_reason(plan: ToolPlan, finish_reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" ("function_call" for a legacy `functions` request) when the model
    chose to call (auto, required), "stop" when the request named the function; a cut-short
    output keeps "length"."""
    if finish_reason != "stop" or plan.mode == "named":
        return finish_reason
    return "function_call" if plan.legacy else "tool_calls"


class ToolStream:
    """One choice's stream when tools are in play: OpenAI-shaped `tool_calls` deltas (for a
    legacy `functions` request, `function_call` deltas of its one call).

    named     the output is the arguments: a first delta with id and name, then each token's
              text as an argument fragment
    required  the output is a JSON array of calls: parsed at the end, one delta per call
    auto      text streams as content, except what may be a call (the parser's marker, held
              back while it could still begin one): that is parsed at the end
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.num_sent = 0  # characters of text streamed as content
        self.call_id = new_call_id()
        self.started = False

    def feed(self, output: CompletionOutput) -> list[ChatStreamChoice]:
        self.text += output.text
        if self.plan.mode == "named":
            choices = self._named(output)
        elif self.plan.mode == "auto":
            choices = self._auto_content(output.index, final=output.finish_reason is not None)
        else:
            choices = []
        if output.finish_reason is not None:
            choices += self._finish(output)
        return choices

    def _named(self, output: CompletionOutput) -> list[ChatStreamChoice]:
        choices = []
        if not self.started:
            self.started = True
            choices.append(
                self._call_delta(
                    output.index,
                    DeltaToolCall(
                        index=0,
                        id=self.call_id,
                        type="function",
                        function=DeltaFunctionCall(name=self.plan.named, arguments=""),
                    ),
                )
            )
        if output.text:
            choices.append(
                self._call_delta(
                    output.index,
                    DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=output.text)),
                )
            )
        return choices

    def _auto_content(self, index: int, final: bool) -> list[ChatStreamChoice]:
        parser = self.plan.parser
        if final or (self.num_sent == 0 and parser.may_start_call(self.text)):
            return []  # the end decides (calls, or the rest as content); or a call may be starting
        if not parser.calls_after_text:
            end = len(self.text)  # calls only ever open the output: the rest is prose
        else:
            marker = parser.find_marker(self.text, self.num_sent)
            keep = max(held_back(self.text, m) for m in parser.all_markers())
            end = marker if marker >= 0 else len(self.text) - keep
        if end <= self.num_sent:
            return []
        piece, self.num_sent = self.text[self.num_sent : end], end
        return [ChatStreamChoice(index=index, delta=DeltaMessage(content=piece))]

    def _finish(self, output: CompletionOutput) -> list[ChatStreamChoice]:
        choices: list[ChatStreamChoice] = []
        finish_reason = output.finish_reason
        if self.plan.mode != "named":
            content, calls = self.plan.calls_from_text(self.text)
            # What was streamed is a prefix of the content (nothing past a marker is sent).
            rest = (content or "")[self.num_sent :] if calls else self.text[self.num_sent :]
            if rest:
                choices.append(
                    ChatStreamChoice(index=output.index, delta=DeltaMessage(content=rest))
                )
            for i, call in enumerate(calls[:1] if self.plan.legacy else calls):
                choices.append(
                    self._call_delta(
                        output.index,
                        DeltaToolCall(
                            index=i,
                            id=new_call_id(),
                            type="function",
                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                        ),
                    )
                )
            if calls:
                finish_reason = tool_finish_reason(self.plan, finish_reason)
        else:
            finish_reason = tool_finish_reason(self.plan, finish_reason)
        last = ChatStreamChoice(
            index=output.index, delta=DeltaMessage(), finish_reason=finish_reason
        )
        last.stop_reason = output.stop_reason
        return choices + [last]

    def _call_delta(self, index: int, call: DeltaToolCall) -> ChatStreamChoice:
        if self.plan.legacy:  # the call's function alone: legacy calls have no id or index
            return ChatStreamChoice(index=index, delta=DeltaMessage(function_call=call.function))
        return ChatStreamChoice(index=index, delta=DeltaMessage(tool_calls=[call]))


def held_back(text: str, marker: str) -> int:
    """Characters at the end of `text` that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
