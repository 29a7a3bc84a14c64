"""Front door: prompts and parameters in, validated EngineRequests out (L4).

Everything a user can get wrong is caught here with a ValueError naming the field, before the
request reaches the engine. `make_request` is where a request's parameters and prompt are
checked, once per request, for the offline LLM and the server alike (the server calls it on a
preparation thread: a grammar check may compile).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from tokenbus.config import EngineConfig
from tokenbus.engine.lora_registry import LoRARegistry
from tokenbus.model_arch import ModelArch
from tokenbus.protocol import EngineRequest, LoRARequest
from tokenbus.sampling_params import SamplingParams
from tokenbus.structured.validator import StructuredOutputValidator

# A prompt: text, or {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = str | Mapping[str, Any]


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        config: EngineConfig,
        eos_token_id: int | None,
        arch: ModelArch,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_id = eos_token_id
        # The model's other EOS ids stop a request as stop_token_ids do (vLLM's way), unless
        # ignore_eos: a request carries one eos_token_id.
        self.extra_eos_token_ids = extra_eos_token_ids
        self.vocab_size = arch.vocab_size
        self.loras = LoRARegistry(config.lora, arch)
        self.structured_validator = StructuredOutputValidator(
            tokenizer,
            arch.vocab_size,
            timeout_s=config.structured_outputs.grammar_compile_timeout,
            max_concurrent=config.structured_outputs.max_concurrent_grammar_compiles,
        )

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            token_ids = self.tokenizer.encode(text, add_special_tokens=True)
        else:
            raise ValueError(
                "prompt: expected a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        if text == "" or not token_ids:
            raise ValueError("prompt: must not be empty")
        return text, token_ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """Apply the model's chat template; return (rendered text, token ids)."""
        if not messages:
            raise ValueError("messages: must be a non-empty list of {'role', 'content'} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(
                    f"messages[{i}]: each message needs a 'role' (and usually 'content')"
                )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "messages: this model has no chat template; send a plain prompt instead"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **dict(chat_template_kwargs or {}),
            )
        except jinja2.TemplateError as exc:
            # The template's own checks (raise_exception: "roles must alternate") and fields it
            # needs but the messages lack: the input's fault, not the server's.
            raise ValueError(
                f"messages: the model's chat template cannot render them: {exc}"
            ) from None
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not token_ids:
            raise ValueError("messages: rendered to an empty prompt")
        return text, token_ids

    def _check_params(self, params: SamplingParams) -> None:
        """`params` with their logprobs resolved (the cap applies to what the engine runs)."""
        if params.structured_outputs is not None:
            self.structured_validator.validate(params.structured_outputs)
        cap = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            requested = getattr(params, name)
            if requested is not None and cap != -1 and requested > cap:
                raise ValueError(
                    f"{name}: requested {requested}, which is more than the maximum "
                    f"allowed ({cap}; raise it with --max-logprobs)"
                )
        for token_id in list(params.stop_token_ids) + list((params.logit_bias or {}).keys()):
            if not 0 <= int(token_id) < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} in stop_token_ids/logit_bias is outside the "
                    f"vocabulary (size {self.vocab_size})"
                )

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        num = len(prompt_token_ids)
        if num >= self.max_model_len:
            raise ValueError(
                f"prompt: this model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {num} tokens (the prompt must leave room for at least one "
                f"generated token)"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is out of vocabulary (size {self.vocab_size})"
            )

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """Check the parameters (grammar included) and the prompt; the request carries the
        parameters as the engine runs them (logprobs -1 spelled out as the vocabulary's size)."""
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(
                f"priority: {priority} needs --scheduling-policy priority (this engine "
                f"schedules {self.config.scheduler.scheduling_policy})"
            )
        self._check_lora(lora_request)
        params = params.with_resolved_logprobs(self.vocab_size)
        if self.extra_eos_token_ids and not params.ignore_eos:
            added = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            if added:
                params = params.clone(stop_token_ids=[*params.stop_token_ids, *added])
        self._check_params(params)
        self._check_prompt(prompt_token_ids)
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            priority=priority,
            lora_request=lora_request,
        )

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter's config and tensor shapes against the model, once per adapter."""
        if lora_request is not None:
            self.loras.id_for(lora_request)
