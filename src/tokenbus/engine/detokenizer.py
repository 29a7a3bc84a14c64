"""Incremental detokenization and stop strings (L4, front end).

Text is produced with `tokenizers.decoders.DecodeStream`, which holds back tokens until they
form whole UTF-8 characters, so no U+FFFD is emitted for a character split across tokens.
Stop strings are matched on the text as it grows; streamed deltas withhold the last
len(longest stop) - 1 characters so that a stop string is never leaked in part.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenbus.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output, so that the first output token gets the leading
# space a SentencePiece-style decoder would strip at the start of a text.
NUM_PREFILL_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
# tokenizers' DecodeStream raises this when a token changes the text decoded before it.
INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Output token ids → text for one request, with stop-string detection.

    `update` feeds new tokens and returns the stop string that ended the request (the request
    then finishes with finish_reason "stop" and stop_reason = that string), or None.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop_strings: list[str] = list(params.stop or [])
        self._include_stop_str = params.include_stop_str_in_output
        # Characters a streamed delta holds back while the request runs.
        self._num_holdback_chars = max((len(s) for s in self._stop_strings), default=1) - 1
        self._num_sent_chars = 0
        self.output_token_ids: list[int] = []  # consumed tokens; none after the stop
        self.output_text = ""  # truncated at the stop string once one matched
        self.stop_reason: str | None = None  # the stop string that matched
        prefill_ids, _ = self._split_clean_tail(prompt_token_ids)
        self._stream = self._new_stream(prefill_ids)

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append the text of `new_token_ids`; return the stop string if one matched.

        Tokens are checked one at a time, so the stop completed by the earliest token wins and
        the tokens after it are not consumed (they are not in `output_token_ids`).
        `stop_terminated`: the last token ended the request (EOS or a stop token id); its text
        is left out unless include_stop_str_in_output, as vLLM does (with special tokens kept,
        an EOS such as "<|im_end|>" would otherwise end the reply's text).
        """
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            if self.is_stopped:
                break
            self.output_token_ids.append(token_id)
            if i == last and stop_terminated and not self._include_stop_str:
                break
            new_text = self._step(token_id)
            if not new_text:
                continue
            self.output_text += new_text
            match = self._find_stop(len(new_text))
            if match is not None:
                self._stop_at(*match)
                return self.stop_reason
        return None

    def get_delta(self, finished: bool = False) -> str:
        """The text added since the last call. While the request runs, the last
        len(longest stop) - 1 characters are held back: they may start a stop string."""
        end = len(self.output_text)
        if not (finished or self.is_stopped):
            end = max(end - self._num_holdback_chars, self._num_sent_chars)
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    # --- decoding ------------------------------------------------------------------------

    def _new_stream(self, prefill_ids: list[int]) -> DecodeStream:
        return DecodeStream(ids=prefill_ids or None, skip_special_tokens=self._skip_special_tokens)

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception as error:
            if INVALID_PREFIX_ERROR not in str(error):
                raise
        # The decoder rewrote earlier text (vllm#17448): restart from the recent output and
        # feed again the tokens that did not yet form whole characters.
        prefill_ids, pending_ids = self._split_clean_tail(self.output_token_ids[:-1])
        self._stream = self._new_stream(prefill_ids)
        return "".join(
            self._stream.step(self._tokenizer, t) or "" for t in pending_ids + [token_id]
        )

    def _split_clean_tail(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Split the last NUM_PREFILL_TOKENS of `token_ids` into a prefill that decodes to
        whole characters and the trailing tokens of an incomplete character."""
        tail = token_ids[-NUM_PREFILL_TOKENS:]
        end = len(tail)
        while end > 0 and self._decode(tail[:end]).endswith(REPLACEMENT_CHAR):
            end -= 1
        start = 0
        while start < end and self._decode(tail[start:end]).startswith(REPLACEMENT_CHAR):
            start += 1
        return tail[start:end], tail[end:]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    # --- stop strings --------------------------------------------------------------------

    def _find_stop(self, num_new_chars: int) -> tuple[str, int] | None:
        """The stop string, and where it starts, that ends earliest among the matches ending
        in the last `num_new_chars` characters (ties: the one that starts first).

        Ending earliest is what a character-by-character stream would see first, so the
        result does not depend on how the text was split into tokens.
        """
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop_strings:
            # A match ending in the new text starts at most len(stop) - 1 characters before it.
            start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[2], best[1])

    def _stop_at(self, stop: str, start: int) -> None:
        end = start + len(stop) if self._include_stop_str else start
        self.output_text = self.output_text[:end]
        self.stop_reason = stop


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the tokenizer
    itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer, "
            f"got {type(tokenizer).__name__}"
        )
    return backend
