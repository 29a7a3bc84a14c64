"""A reasoning model's reply split into reasoning and content (L5), named as vLLM's
`--reasoning-parser` options:

    deepseek_r1  the reply opens inside the reasoning (R1's template puts <think> in the
                 prompt, or the model writes it first): text up to </think> is reasoning,
                 the rest content; a reply with no </think> is all reasoning
    qwen3        reasoning only once a <think> opens it, in the reply or left open at the end
                 of the prompt (templates that open it for the model); </think> closes it;
                 with chat_template_kwargs {"enable_thinking": false} the reply is all content
    glm45        GLM-4.5's (4.6's, 4.7's): qwen3's rule, which its template shares
    openai_gptoss  gpt-oss's harmony format: each analysis message
                 (<|channel|>analysis<|message|> ... <|end|>) is reasoning, joined as they come,
                 the final channel content, its header (<|start|>assistant<|channel|>final
                 <|message|>) dropped; the markers are special tokens, so the text keeps them

Tags are told by token id where the tokenizer has each tag as one token (Qwen3's and R1's do):
then only those tokens count, not the same characters spelled with other tokens. Otherwise the
text decides. Either way the split is made in the text: a stream holds back the first characters
of a tag until a later delta shows whether they are one, so no tag is leaked in part.

After the reasoning ends everything is content, tags included, but for a parser's `dropped`
markers (harmony's channel headers), which frame the content and never show; the first <think>
inside the reasoning (a model that writes it although the prompt opened one) is dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenbus.api.openai.tool_stream import held_back


class Phase(enum.Enum):
    BEFORE = "before"  # no reasoning yet: content, until a start tag opens it
    REASONING = "reasoning"  # reasoning, until the end tag
    CONTENT = "content"  # the reasoning is over (or there is none): the rest is content


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    name: str
    start_tag = "<think>"
    end_tag = "</think>"
    dropped: tuple[str, ...] = ()  # markers outside the reasoning dropped from the content
    reopens = False  # a start tag after the reasoning ended opens it again (harmony's messages)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        ids = {tag: _single_token_id(tokenizer, vocab, tag) for tag in self.tags}
        # Token ids only when both tags are single tokens.
        self.tag_ids: dict[str, int] | None = (
            None if None in ids.values() else {tag: i for tag, i in ids.items() if i is not None}
        )
        # A tag that is a special token vanishes from text decoded with skip_special_tokens.
        self.needs_special_tokens = self.tag_ids is not None and any(
            tag not in tokenizer.decode([i], skip_special_tokens=True)
            for tag, i in self.tag_ids.items()
        )

    @property
    def tags(self) -> tuple[str, str]:
        return self.start_tag, self.end_tag

    def first_phase(
        self,
        prompt_token_ids: Sequence[int],
        prompt_text: str | None,
        template_kwargs: dict[str, Any] | None,
    ) -> Phase:
        """The phase a reply to this prompt opens in: inside the reasoning when the prompt left
        a start tag open (templates that open it for the model), else before it."""
        if self.prompt_opens_reasoning(prompt_token_ids, prompt_text):
            return Phase.REASONING
        return Phase.BEFORE

    def prompt_opens_reasoning(
        self, prompt_token_ids: Sequence[int], prompt_text: str | None
    ) -> bool:
        """Whether the prompt's last tag is a start tag: the reply continues inside it."""
        if self.tag_ids is not None:
            start_id, end_id = self.tag_ids[self.start_tag], self.tag_ids[self.end_tag]
            for token_id in reversed(prompt_token_ids):
                if token_id in (start_id, end_id):
                    return token_id == start_id
            return False
        if prompt_text is None:  # truncated: the text sent is that of the tokens kept
            prompt_text = self.tokenizer.decode(list(prompt_token_ids))
        return prompt_text.rfind(self.start_tag) > prompt_text.rfind(self.end_tag)


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages, told by their text: reasoning from each analysis channel
    header to its <|end|> (a reply may hold several), content the rest with the final channel's
    header dropped (a reply that skips the analysis opens with that header). Every marker is a
    special token of o200k_harmony, so the reply is detokenized with them kept."""

    name = "openai_gptoss"
    start_tag = "<|channel|>analysis<|message|>"
    end_tag = "<|end|>"
    dropped = ("<|start|>assistant", "<|channel|>final<|message|>")
    reopens = True

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.needs_special_tokens = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def first_phase(self, prompt_token_ids, prompt_text, template_kwargs) -> Phase:
        return Phase.REASONING


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def first_phase(self, prompt_token_ids, prompt_text, template_kwargs) -> Phase:
        # `is False`, as the template's own test (`enable_thinking is false`) reads it.
        if (template_kwargs or {}).get("enable_thinking") is False:
            return Phase.CONTENT
        return super().first_phase(prompt_token_ids, prompt_text, template_kwargs)


class Glm45ReasoningParser(Qwen3ReasoningParser):
    """GLM-4.5's template opens and closes <think> as Qwen3's does, and keys on the same
    enable_thinking: vLLM's name for it."""

    name = "glm45"


@dataclass(frozen=True)
class ReasoningPlan:
    """How the replies to one request split: the server's parser and the phase they open in."""

    parser: ReasoningParser
    first_phase: Phase

    @property
    def may_reason(self) -> bool:
        return self.first_phase is not Phase.CONTENT

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.first_phase)

    def split(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished reply. Content is None when the reply reasoned and
        said nothing after (vLLM's answer when it stops right after </think>)."""
        piece = self.stream().feed(text, token_ids, final=True)
        content = piece.content if piece.content or not piece.reasoning else None
        return piece.reasoning or None, content

    def num_reasoning_tokens(self, token_ids: Sequence[int], reasoning: str | None) -> int:
        """Tokens of a finished reply's reasoning, its tags included where they are tokens;
        otherwise those of its reasoning text, encoded again."""
        tag_ids = self.parser.tag_ids
        if tag_ids is None:
            encode = self.parser.tokenizer.encode
            return len(encode(reasoning, add_special_tokens=False)) if reasoning else 0
        start_id, end_id = tag_ids[self.parser.start_tag], tag_ids[self.parser.end_tag]
        phase, count = self.first_phase, 0
        for token_id in token_ids:
            if phase is Phase.BEFORE and token_id == start_id:
                phase = Phase.REASONING
            if phase is Phase.REASONING:
                count += 1
                if token_id == end_id:
                    phase = Phase.CONTENT
        return count


class ReasoningStream:
    """One reply's deltas → reasoning and content deltas."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self.parser = parser
        self.phase = phase
        self.opened = False  # a start tag was dropped: later ones are reasoning text
        self.pending = ""  # text not yet given out: it may begin a tag
        # Per tag, tokens arrived whose text is not yet consumed: the detokenizer may send a
        # token's text a delta later (it holds back what may begin a stop string).
        self.arrived = None if parser.tag_ids is None else dict.fromkeys(parser.tags, 0)

    def feed(self, text: str, token_ids: Sequence[int] = (), final: bool = False) -> ReasoningDelta:
        """`final`: no more text comes, so what was held back is given out."""
        if self.arrived is not None:
            for tag, tag_id in self.parser.tag_ids.items():
                self.arrived[tag] += list(token_ids).count(tag_id)
        self.pending += text
        out: dict[Phase, list[str]] = {Phase.REASONING: [], Phase.CONTENT: []}
        while self.pending:
            sink = out[Phase.REASONING if self.phase is Phase.REASONING else Phase.CONTENT]
            tags = self._expected()
            hits = [(self.pending.find(tag), tag) for tag in tags if tag in self.pending]
            if not hits:
                keep = 0 if final else max((held_back(self.pending, t) for t in tags), default=0)
                cut = len(self.pending) - keep
                sink.append(self.pending[:cut])
                self.pending = self.pending[cut:]
                break
            index, tag = min(hits)
            sink.append(self.pending[:index])
            self.pending = self.pending[index + len(tag) :]
            self._consume(tag)
        return ReasoningDelta("".join(out[Phase.REASONING]), "".join(out[Phase.CONTENT]))

    def _expected(self) -> list[str]:
        """The tags that would change the phase now (by token id: those whose token came)."""
        if self.phase is Phase.CONTENT:
            tags = [self.parser.start_tag] if self.parser.reopens else []
        elif self.phase is Phase.BEFORE:
            tags = [self.parser.start_tag]
        else:
            tags = [self.parser.end_tag] + ([] if self.opened else [self.parser.start_tag])
        if self.arrived is not None:
            tags = [t for t in tags if self.arrived[t] > 0]
        if self.phase is not Phase.REASONING:
            tags += self.parser.dropped  # by their text, whatever the tokenizer
        return tags

    def _consume(self, tag: str) -> None:
        if tag in self.parser.dropped:
            return
        if self.arrived is not None:
            self.arrived[tag] -= 1
        if tag == self.parser.start_tag:
            self.opened, self.phase = True, Phase.REASONING
        else:
            self.phase = Phase.CONTENT


def _single_token_id(tokenizer: Any, vocab: dict[str, int], tag: str) -> int | None:
    """The tag's token id when the tokenizer encodes the tag's text as that one token."""
    token_id = vocab.get(tag)
    if token_id is None or tokenizer.encode(tag, add_special_tokens=False) != [token_id]:
        return None
    return token_id


PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (
        *(DeepSeekR1ReasoningParser, Qwen3ReasoningParser, Glm45ReasoningParser),
        HarmonyReasoningParser,
    )
}


def make_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(
            f"reasoning_parser: unknown parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name](tokenizer)
