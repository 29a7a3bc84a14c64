"""Building schedulers and fake runner outputs for core tests (vLLM tests/v1/core style)."""

from __future__ import annotations

from collections.abc import Callable

from tokenbus.config import SchedulerConfig
from tokenbus.core.kv import KVCacheManager, make_block_hasher
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.request import Request
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.core.sched.scheduler import Scheduler
from tokenbus.sampling_params import SamplingParams

EOS = 0
BLOCK_SIZE = 16


def make_scheduler(
    num_blocks: int = 100,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    long_prefill_token_threshold: int = 0,
    max_model_len: int = 1024,
    enable_caching: bool = False,
    **scheduler_kwargs,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_model_len=max_model_len,
    )
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
    return Scheduler(config, kv, **scheduler_kwargs)


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int | None = 16,
    first_token: int = 100,
    enable_caching: bool = False,
    **params,
) -> Request:
    params.setdefault("ignore_eos", False)
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    prompt = [first_token + i for i in range(num_prompt_tokens)]
    hasher = make_block_hasher(BLOCK_SIZE) if enable_caching else None
    return Request(request_id, prompt, sampling, eos_token_id=EOS, block_hasher=hasher)


def fake_runner_output(
    so: SchedulerOutput, scheduler: Scheduler, token: int | Callable[[str], list[int]] = 7
) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled chunk reached its last known token."""
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])  # partial prefill chunk: its sample is dropped
        else:
            sampled.append(token(req_id) if callable(token) else [token])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_step(scheduler: Scheduler, token: int | Callable[[str], list[int]] = 7):
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, fake_runner_output(so, scheduler, token))
    return so, outputs


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 10_000, token=7
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = run_step(scheduler, token)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    scheduler.check_integrity()
    return tokens


class FakeGrammars:
    """The GrammarManager port without xgrammar. A request's grammar is compiled once its id is
    in `ready` (every one when `ready` is None); tokens from `valid_below` on break the grammar
    (drafts are cut there); accepted tokens are recorded in order."""

    def __init__(self, ready: set[str] | None = None, valid_below: int | None = None) -> None:
        self.ready = ready
        self.valid_below = valid_below
        self.accepted: list[int] = []

    def add_request(self, request: Request) -> None:
        pass

    def is_ready(self, request: Request) -> bool:
        return self.ready is None or request.request_id in self.ready

    def fill_bitmask(self, scheduler_output: SchedulerOutput, requests: dict) -> None:
        pass

    def validate_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        valid = []
        for token in token_ids:
            if self.valid_below is not None and token >= self.valid_below:
                break
            valid.append(token)
        return valid

    def accept_tokens(self, request: Request, token_ids: list[int]) -> None:
        self.accepted.extend(token_ids)

    def remove_request(self, request: Request) -> None:
        pass
