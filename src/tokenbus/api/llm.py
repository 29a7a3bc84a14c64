"""The offline API, shaped like vLLM's so users can switch by changing an import (L5).

from tokenbus import LLM, SamplingParams
llm = LLM()                       # the packaged SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from tokenbus.engine.input_processor import PromptType
from tokenbus.engine.llm_engine import LLMEngine
from tokenbus.engine.outputs import RequestOutput
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import LoRARequest
from tokenbus.sampling_params import SamplingParams

Conversation = Sequence[Mapping[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """Build from a ready EngineArgs (the CLI, the benchmarks): the same as passing each of
        its fields as a keyword, so both paths validate and build the engine alike."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: SamplingParams' defaults,
        with the model's recommended sampling settings (--generation-config) in their place."""
        return SamplingParams(**self.engine.setup.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one per prompt, under --scheduling-policy priority (lower first).
        `lora_request`: the LoRA adapter to run with (enable_lora), one for all prompts or one
        (or None: the base model) per prompt."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: {len(priority)} values for {len(prompts)} prompts")
        processor = self.engine.input_processor
        tokenized = [processor.tokenize(p) for p in prompts]
        return self._run(tokenized, sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        processor = self.engine.input_processor
        rendered = [
            processor.render_chat(c, add_generation_prompt, chat_template_kwargs)
            for c in conversations
        ]
        return self._run(rendered, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(
        self,
        tokenized: list[tuple[str | None, list[int]]],
        sampling_params,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _broadcast_params(sampling_params, len(tokenized))
        loras = _broadcast_loras(lora_request, len(tokenized))
        ids = []
        try:
            priorities = priority or [0] * len(tokenized)
            for (text, token_ids), params, rank, lora in zip(
                tokenized, params_list, priorities, loras
            ):
                request_id = str(next(self._counter))
                self.engine.add_request(
                    request_id, token_ids, params, prompt=text, priority=rank, lora_request=lora
                )
                ids.append(request_id)
        except ValueError:
            self.engine.abort_request(_all_child_ids(self.engine, ids))
            raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine.client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        """Stop the engine process now (otherwise it stops when this process exits)."""
        self.engine.shutdown()


def _broadcast_params(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(
            f"sampling_params: got {len(params)} for {num_prompts} prompts; "
            "pass one, or one per prompt"
        )
    return params


def _broadcast_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"lora_request: got {len(loras)} for {num_prompts} prompts; pass one, or one per prompt"
        )
    return loras


def _all_child_ids(engine: LLMEngine, parent_ids: list[str]) -> list[str]:
    parents = set(parent_ids)
    return [
        cid
        for cid, child in engine.output_processor.children.items()
        if child.parent.request_id in parents
    ]
