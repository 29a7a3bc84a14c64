"""A test double with AsyncLLM's interface: no model, no processes, instant and deterministic.

Child `i` of a request generates the letters "abcdefg…" starting at letter `i`, one token per
step; the token id of a character is its code point. Stop strings, max_tokens, logprobs and n
behave as the real engine's do, so the serving code can be tested in milliseconds.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from types import SimpleNamespace

from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.input_processor import InputProcessor
from tokenbus.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tokenbus.engine.xray_hub import XrayHub
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams

VOCAB_SIZE = 300
MAX_MODEL_LEN = 128


class CharTokenizer:
    """One token per character (code points below VOCAB_SIZE)."""

    chat_template = "fake"
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB_SIZE for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [chr(t) for t in token_ids]

    def apply_chat_template(
        self, messages, tokenize=False, add_generation_prompt=True, **kwargs
    ) -> str:
        text = "".join(f"<{m['role']}>{m.get('content', '')}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeAsyncLLM:
    def __init__(
        self, token_delay_s: float = 0.0, max_model_len: int = MAX_MODEL_LEN, **engine_args
    ) -> None:
        args = EngineArgs(**engine_args)
        self.config = args.to_config(max_model_len)
        self.setup = SimpleNamespace(sampling_defaults={})
        self.tokenizer = CharTokenizer()
        arch = SimpleNamespace(vocab_size=VOCAB_SIZE)  # all the front end reads of a ModelArch
        self.input_processor = InputProcessor(self.tokenizer, self.config, 0, arch)
        # Grammars need a real vocabulary; the serving code only has to pass the spec along.
        self.input_processor.structured_validator = SimpleNamespace(validate=lambda spec: None)
        self.token_delay_s = token_delay_s
        self.errored = False
        self.silent_s: float | None = None
        self.script: str | None = None  # when set, every child "generates" this text, then stops
        self.stack_dumps = 0
        self.dead_error: EngineDeadError | None = None
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.engine_requests: list[EngineRequest] = []  # as built by the input processor
        self.xray_hub = XrayHub()  # /xray: no scheduler behind this engine, so no snapshot

    async def xray_watch(self, seconds: float) -> None:
        pass

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ):
        request = self.input_processor.make_request(request_id, prompt_token_ids, params)
        async with aclosing(self.generate_request(request, prompt)) as outputs:
            async for output in outputs:
                yield output

    async def generate_request(self, request: EngineRequest, prompt: str | None = None):
        if self.errored:
            raise self.dead_error
        request_id, prompt_token_ids = request.request_id, request.prompt_token_ids
        params = request.sampling_params
        self.requests.append((request_id, prompt_token_ids, params))
        self.engine_requests.append(request)
        self.running.add(request_id)
        try:
            async for output in self._run(request_id, prompt_token_ids, params, prompt):
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise
        finally:
            self.running.discard(request_id)

    async def _run(self, request_id, prompt_token_ids, params, prompt):
        texts = {i: "" for i in range(params.n)}
        cumulative = {i: 0.0 for i in range(params.n)}
        done: set[int] = set()
        for step in range(params.max_tokens):
            for i in range(params.n):
                if i in done:
                    continue
                await asyncio.sleep(self.token_delay_s)
                if self.errored:
                    raise self.dead_error
                if self.script is not None:
                    token_id = ord(self.script[step])
                    texts[i] += chr(token_id)
                    finish, stop_reason = (
                        ("stop", None)
                        if step + 1 == len(self.script)
                        else self._finish(texts[i], step, params)
                    )
                else:
                    token_id = ord("a") + (step + i) % 26
                    texts[i] += chr(token_id)
                    finish, stop_reason = self._finish(texts[i], step, params)
                if finish:
                    done.add(i)
                logprobs = (
                    None if params.logprobs is None else [_logprobs(token_id, params.logprobs, i)]
                )
                if logprobs is not None:
                    cumulative[i] += logprobs[0][token_id].logprob
                completion = CompletionOutput(
                    index=i,
                    text=chr(token_id),
                    token_ids=[token_id],
                    cumulative_logprob=None if logprobs is None else cumulative[i],
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                )
                yield RequestOutput(
                    request_id,
                    prompt,
                    prompt_token_ids,
                    [completion],
                    finished=len(done) == params.n,
                )

    @staticmethod
    def _finish(text: str, step: int, params: SamplingParams) -> tuple[str | None, str | None]:
        for stop in params.stop:
            if text.endswith(stop):
                return "stop", stop
        if step + 1 >= params.max_tokens:
            return "length", None
        return None, None

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def kill(self) -> None:
        self.errored = True
        self.dead_error = EngineDeadError()

    def seconds_without_progress(self) -> float | None:
        return self.silent_s  # tests set it to play a stalled engine

    def dump_engine_stacks(self) -> None:
        self.stack_dumps += 1

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running)

    last_scheduler_stats = None

    def shutdown(self) -> None:
        pass


def _logprobs(token_id: int, num_top: int, child: int = 0) -> dict[int, Logprob]:
    """The sampled token ranks first (less likely in later children: child i's is -0.1 (i + 1));
    the rest of the top-n follow it alphabetically."""
    result = {token_id: Logprob(-0.1 * (child + 1), 1, chr(token_id))}
    for rank in range(2, num_top + 1):
        other = ord("a") + (token_id - ord("a") + rank - 1) % 26
        result[other] = Logprob(-float(rank), rank, chr(other))
    return result
