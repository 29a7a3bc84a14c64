"""POST /tokenize and /detokenize, and GET /v1/models (L5)."""

from __future__ import annotations

from tokenbus.api.openai.errors import NotFoundError
from tokenbus.api.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from tokenbus.api.openai.serving_chat import normalize_message, template_kwargs
from tokenbus.api.openai.serving_engine import OpenAIServing


class TokenizeServing(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.preflight(request, request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if request.messages is not None:
            self.check_messages(request.messages)
        else:
            self.check_text_length("prompt", len(request.prompt))
        return await self.prepare(self._tokenize, request)

    def _tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        processor = self.engine.input_processor
        if request.messages is not None:
            messages = [normalize_message(m, i) for i, m in enumerate(request.messages)]
            _, token_ids = processor.render_chat(
                messages,
                request.add_generation_prompt,
                template_kwargs(request.chat_template_kwargs),
            )
        else:
            token_ids = self.engine.tokenizer.encode(
                request.prompt, add_special_tokens=request.add_special_tokens
            )
        token_strs = None
        if request.return_token_strs:
            token_strs = self.engine.tokenizer.convert_ids_to_tokens(token_ids)
        return TokenizeResponse(
            count=len(token_ids),
            max_model_len=processor.max_model_len,
            tokens=token_ids,
            token_strs=token_strs,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.preflight(request, request.model)
        # As many tokens as characters of text /tokenize would take: a token is at least one.
        self.check_text_length("tokens", len(request.tokens))
        vocab_size = self.engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab_size})"
            )
        text = await self.prepare(self.engine.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)

    def model_card(self, model: str) -> ModelCard:
        if model not in self.ctx.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")
        max_model_len = self.engine.input_processor.max_model_len
        return ModelCard(id=model, root=model, max_model_len=max_model_len)

    def tokenizer_info(self) -> TokenizerInfoResponse:
        tokenizer = self.engine.tokenizer
        return TokenizerInfoResponse(
            tokenizer_class=type(tokenizer).__name__,
            chat_template=getattr(tokenizer, "chat_template", None),
            model_max_length=self.engine.input_processor.max_model_len,
            vocab_size=self.engine.input_processor.vocab_size,
            bos_token=_token_text(getattr(tokenizer, "bos_token", None)),
            eos_token=_token_text(getattr(tokenizer, "eos_token", None)),
            pad_token=_token_text(getattr(tokenizer, "pad_token", None)),
        )

    def models(self) -> ModelList:
        max_model_len = self.engine.input_processor.max_model_len
        return ModelList(
            data=[
                ModelCard(id=name, root=name, max_model_len=max_model_len)
                for name in self.ctx.served_model_names
            ]
        )


def _token_text(token) -> str | None:
    """A special token as text (tokenizers hold str or AddedToken)."""
    return None if token is None else str(token)
