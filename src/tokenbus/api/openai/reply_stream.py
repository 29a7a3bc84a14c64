"""One chat choice's stream as OpenAI chunks (L5): the reasoning split off first
(--reasoning-parser), tool calls parsed from what is left (ToolStream), the rest content.
The chat, Responses and Messages streams all read a reply through it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tokenbus.api.openai.protocol import ChatStreamChoice, DeltaMessage
from tokenbus.api.openai.reasoning_parsers import ReasoningPlan
from tokenbus.api.openai.tool_stream import ToolStream
from tokenbus.api.openai.tools import ToolPlan
from tokenbus.engine.outputs import CompletionOutput


def reasoning_delta(reasoning: str, content: str | None = None) -> DeltaMessage:
    """A delta with reasoning under both its names (and content, when there is some)."""
    fields = {"content": content} if content else {}
    return DeltaMessage(reasoning=reasoning, reasoning_content=reasoning, **fields)


class ReplyStream:
    """`content_choice` makes the choice of an output that carries content alone (the chat's
    adds logprobs and token ids); a delta's reasoning joins it, or comes first in a choice of
    its own when tools are in play."""

    def __init__(
        self,
        reasoning: ReasoningPlan | None,
        tools: ToolPlan | None,
        content_choice: Callable[[CompletionOutput], ChatStreamChoice],
    ) -> None:
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.tools = ToolStream(tools) if tools is not None and tools.mode != "none" else None
        self.content_choice = content_choice

    def feed(self, output: CompletionOutput) -> list[ChatStreamChoice]:
        reasoning = ""
        if self.reasoning is not None:
            piece = self.reasoning.feed(output.text, output.token_ids, output.finished())
            reasoning, output = piece.reasoning, dataclasses.replace(output, text=piece.content)
        if self.tools is not None:
            choices = self.tools.feed(output)
            if reasoning:
                choices.insert(
                    0, ChatStreamChoice(index=output.index, delta=reasoning_delta(reasoning))
                )
            return choices
        if not (output.text or output.token_ids or output.finish_reason or reasoning):
            return []
        choice = self.content_choice(output)
        if reasoning:
            choice.delta = reasoning_delta(reasoning, choice.delta.content)
        return [choice]
