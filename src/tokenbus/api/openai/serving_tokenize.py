"""POST /tokenize and /detokenize, and GET /v1/models (L5)."""

from __future__ import annotations

from tokenbus.api.openai.errors import NotFoundError
from tokenbus.api.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from tokenbus.api.openai.serving_chat import ChatServing
from tokenbus.api.openai.serving_engine import OpenAIServing, ServingContext


class TokenizeServing(OpenAIServing):
    def __init__(self, ctx: ServingContext, chat: ChatServing) -> None:
        super().__init__(ctx)
        self.chat = chat  # renders `messages` exactly as a chat completion would

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.preflight(request, request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if request.messages is not None:
            self.check_messages(request.messages, request.tools)
        else:
            if request.tools is not None:
                raise ValueError("tools: only with messages")
            self.check_text_length("prompt", len(request.prompt))
        return await self.prepare(self._tokenize, request)

    def _tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        processor = self.engine.input_processor
        if request.messages is not None:
            token_ids = self.chat.render(self._as_chat(request)).token_ids
        else:
            add_special_tokens = request.add_special_tokens is not False
            token_ids = self.engine.tokenizer.encode(
                request.prompt, add_special_tokens=add_special_tokens
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

    def _as_chat(self, request: TokenizeRequest) -> ChatCompletionRequest:
        """The chat completion whose prompt `request` counts. Tools are shown to the model
        unless tool_choice is "none" (how they are shown is the same for auto, required and a
        named function, so "auto" needs no --enable-auto-tool-choice here)."""
        tool_choice = request.tool_choice
        if request.tools and tool_choice in (None, "auto"):
            tool_choice = "auto" if self.ctx.tool_parser is not None else "required"
        return ChatCompletionRequest(
            messages=request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
            tool_choice=tool_choice,
            documents=request.documents,
            add_special_tokens=request.add_special_tokens,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.preflight(request, request.model)
        # As many tokens as characters of text /tokenize would take: a token is at least one.
        self.check_text_length("tokens", len(request.tokens))
        vocab_size = self.engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"tokens: token id {bad[0]} is out of vocabulary (size {vocab_size})")
        text = await self.prepare(self.engine.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)

    def model_card(self, model: str) -> ModelCard:
        for card in self.models().data:
            if card.id == model:
                return card
        raise NotFoundError(f"The model `{model}` does not exist.", param="model")

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
        base = self.ctx.served_model_names
        adapters = self.ctx.loras.by_name.values() if self.ctx.loras is not None else ()
        return ModelList(
            data=[
                *(ModelCard(id=name, root=name, max_model_len=max_model_len) for name in base),
                *(
                    ModelCard(
                        id=lora.lora_name,
                        root=lora.lora_path,
                        parent=base[0],
                        max_model_len=max_model_len,
                    )
                    for lora in adapters
                ),
            ]
        )


def _token_text(token) -> str | None:
    """A special token as text (tokenizers hold str or AddedToken)."""
    return None if token is None else str(token)
