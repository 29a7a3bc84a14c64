"""Engine logprobs (one {token_id: Logprob} dict per sampled position) → OpenAI's two shapes
(L5)."""

from __future__ import annotations

from collections.abc import Callable

from tokenbus.api.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    PromptLogprob,
    TopLogprob,
)
from tokenbus.engine.outputs import Logprob

Decode = Callable[[int], str]
# OpenAI's stand-in for "not computed" (JSON has no -inf).
MISSING_LOGPROB = -9999.0


def _token_text(token_id: int, logprob: Logprob | None, decode: Decode) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def _shown(token_id: int, logprob: Logprob | None, decode: Decode, as_ids: bool) -> str:
    """A token as the response names it: its text, or (return_tokens_as_token_ids, vLLM)
    "token_id:N", which survives tokens that are not whole characters."""
    return f"token_id:{token_id}" if as_ids else _token_text(token_id, logprob, decode)


def _top(position: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely tokens. The dict holds the sampled token plus the top-n, so when
    the sampled token ranks below n it is the one entry left out here."""
    ranked = sorted(
        position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0
    )
    return ranked[:num_top]


def completion_logprobs(
    token_ids: list[int],
    positions: list[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    decode: Decode,
    as_ids: bool = False,
) -> CompletionLogProbs:
    """Legacy completions format; `text_offset` is where this delta's text starts in the choice.
    A position of None (the first prompt token, echoed) has no logprobs: null, as OpenAI sends.

    Each top_logprobs entry holds the sampled token first, then the `num_top` most likely
    (OpenAI's legacy API: up to logprobs + 1 entries; logprobs 0 gives the sampled one alone),
    as vLLM sends them."""
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        sampled = position.get(token_id) if position is not None else None
        result.tokens.append(_shown(token_id, sampled, decode, as_ids))
        result.token_logprobs.append(sampled.logprob if sampled else None)
        result.text_offset.append(text_offset)
        text_offset += len(_token_text(token_id, sampled, decode))
        if position is None:
            result.top_logprobs.append(None)
            continue
        top = {token_id: sampled} if sampled else {}
        top.update((t, lp) for t, lp in _top(position, num_top) if t not in top)
        result.top_logprobs.append(
            {_shown(t, lp, decode, as_ids): lp.logprob for t, lp in top.items()}
        )
    return result


def prompt_logprobs_body(
    positions: list[dict[int, Logprob] | None],
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, {token id: logprob, rank, text}."""
    return [
        None
        if position is None
        else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in position.items()
        }
        for position in positions
    ]


def chat_logprobs(
    token_ids: list[int],
    positions: list[dict[int, Logprob]],
    num_top: int,
    decode: Decode,
    as_ids: bool = False,
) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        sampled = position.get(token_id)
        token = _shown(token_id, sampled, decode, as_ids)
        top = [
            TopLogprob(
                token=(text := _shown(t, lp, decode, as_ids)),
                logprob=lp.logprob,
                bytes=list(text.encode()),
            )
            for t, lp in _top(position, num_top)
        ]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=sampled.logprob if sampled else MISSING_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def merge_completion_logprobs(
    into: CompletionLogProbs | None, more: CompletionLogProbs
) -> CompletionLogProbs:
    if into is None:
        return more
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.text_offset += more.text_offset
    into.top_logprobs += more.top_logprobs
    return into
