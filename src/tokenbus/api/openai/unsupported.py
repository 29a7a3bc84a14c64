"""Request fields vLLM or OpenAI define that this server does not implement (L5).

Unknown fields are accepted and logged (clients such as LangChain send extras), but a field a
client sends expecting an effect must not be dropped in silence: the output would differ from
what was asked without anyone noticing. Each field here is refused with a 400 naming it, unless
its value asks for nothing (a client may spell out a default).
"""

from __future__ import annotations

from typing import Any

from tokenbus.api.openai.protocol import OpenAIRequest

# name → (the values that ask for nothing, what to do instead or why not)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "allowed_token_ids": ((None,), "use logit_bias or structured_outputs"),
    "bad_words": ((None, []), "use logit_bias"),
    "logprob_token_ids": ((None, []), "use logprobs / top_logprobs"),
    "vllm_xargs": ((None, {}), "this server has no custom extensions"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer does"),
    "watermarking": ((None, False), ""),
    "repetition_detection": ((None,), ""),
    "thinking_token_budget": ((None, -1), ""),
    "prompt_embeds": ((None, []), "send text or token ids"),
    "mm_processor_kwargs": ((None, {}), "this server serves text models"),
    "media_io_kwargs": ((None, {}), "this server serves text models"),
    "ec_transfer_params": ((None,), ""),
    "stream_interval": ((None, 1), "each step's tokens are streamed as they come"),
    "return_token_offsets": ((None, False), ""),
    "return_prompt_text": ((None, False), "POST /tokenize with the messages shows the prompt"),
    "routed_experts_prompt_start": ((None, 0), ""),
    "chat_template": ((None,), "the model's own chat template renders every chat"),
    "guided_whitespace_pattern": ((None,), ""),
    "audio": ((None,), "this server serves text models"),
    "modalities": ((None, ["text"]), "this server answers with text only"),
    "prediction": ((None,), ""),
    "web_search_options": ((None,), ""),
}

# Keys of `structured_outputs` beyond the constraint itself: those that ask for nothing here.
STRUCTURED_OUTPUTS_NO_OPS: dict[str, tuple[Any, ...]] = {
    # There is one backend (xgrammar) and nothing to fall back to.
    "disable_fallback": (None, True, False),
}


def check_unsupported(request: OpenAIRequest) -> list[str]:
    """A ValueError naming the first field of UNSUPPORTED_FIELDS that asks for something;
    otherwise the unknown fields that are left (to be logged as ignored)."""
    unknown = []
    for name in request.unknown_fields():
        entry = UNSUPPORTED_FIELDS.get(name)
        if entry is None:
            unknown.append(name)
            continue
        no_ops, hint = entry
        if request.model_extra[name] not in no_ops:
            raise ValueError(
                f"{name}: not supported by this server" + (f" ({hint})" if hint else "")
            )
    return unknown


def check_structured_outputs_keys(extra: dict[str, Any] | None) -> None:
    """`structured_outputs` keys beyond json, regex, choice, grammar and json_object (vLLM's
    whitespace and structural-tag options) change the constraint: refused, not dropped."""
    for key, value in (extra or {}).items():
        if value not in STRUCTURED_OUTPUTS_NO_OPS.get(key, (None,)):
            raise ValueError(
                f"structured_outputs: {key} is not supported (json, regex, choice, grammar and "
                f"json_object are)"
            )
