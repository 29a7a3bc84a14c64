"""LLMEngine: the synchronous front end used by the offline `LLM` (L4).

add_request → (input processing) → EngineCore client → step → (output processing) → outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from tokenbus.config import EngineArgs
from tokenbus.core.sched.spec_metrics import SpecDecodeMetrics
from tokenbus.engine.client_factory import start_engine
from tokenbus.engine.core_client import EngineCoreClient
from tokenbus.engine.input_processor import InputProcessor
from tokenbus.engine.output_processor import OutputKind, OutputProcessor, ParentRequest
from tokenbus.engine.outputs import RequestMetrics, RequestOutput
from tokenbus.engine.setup import EngineSetup, create_engine_setup
from tokenbus.protocol import EngineRequest, SchedulerStats
from tokenbus.sampling_params import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Children sample independently: n=1 each, seed + index when seeded (as vLLM does). They
    share the prompt, so only the first computes its logprobs."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return params.clone(n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def register_children(
    input_processor: InputProcessor,
    output_processor: OutputProcessor,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    prompt: str | None,
    kind: OutputKind,
    arrival_time: float,
    cache_salt: str | None,
) -> list[EngineRequest]:
    """Build the n child requests of one request, validating every child before any is
    registered (all or nothing), then register them with the output processor."""
    requests = [
        input_processor.make_request(
            child_id, prompt_token_ids, child_params(params, i), arrival_time, cache_salt
        )
        for i, child_id in enumerate(child_request_ids(request_id, params.n))
    ]
    parent = ParentRequest(
        request_id,
        prompt,
        prompt_token_ids,
        params.n,
        kind,
        RequestMetrics(arrival_time=arrival_time),
    )
    for i, request in enumerate(requests):
        output_processor.add_request(parent, request.request_id, i, request.sampling_params)
    return requests


class LLMEngine:
    def __init__(self, setup: EngineSetup, tokenizer, client: EngineCoreClient) -> None:
        self.setup = setup
        self.config = setup.config
        self.tokenizer = tokenizer
        self.client = client
        self.input_processor = InputProcessor(
            tokenizer, setup.config, setup.eos_token_id, setup.arch.vocab_size
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.last_stats: SchedulerStats | None = None
        self.spec_metrics = SpecDecodeMetrics()  # summed over every step (see measure_spec_decode)
        # Running sums of the per-step counters (benchmarks and logs read them).
        self.stats_totals = {
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            "num_prompt_tokens": 0,
            "spec_num_drafts": 0,
            "spec_num_draft_tokens": 0,
            "spec_num_accepted_tokens": 0,
            "external_prefix_cache_queries": 0,
            "external_prefix_cache_hits": 0,
            "kv_bytes_loaded": 0,
            "kv_bytes_saved": 0,
        }

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Resolve the model, load the tokenizer and start the engine: in its own process
        unless `args.multiprocess` is False (blocks until ready; raises if it cannot start)."""
        setup = create_engine_setup(args)
        tokenizer, client = start_engine(
            setup,
            multiprocess=args.multiprocess,
            asyncio_mode=False,
            ready_timeout_s=args.engine_ready_timeout_s,
        )
        return cls(setup, tokenizer, client)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        kind: OutputKind = OutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        arrival_time = time.time() if arrival_time is None else arrival_time
        for request in register_children(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt_token_ids,
            params,
            prompt,
            kind,
            arrival_time,
            cache_salt,
        ):
            self.client.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.client.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        engine_outputs = self.client.get_output()
        stats = engine_outputs.scheduler_stats
        if stats is not None:
            self.last_stats = stats
            self.spec_metrics.add(stats)
            for key in self.stats_totals:
                self.stats_totals[key] += getattr(stats, key)
        processed = self.output_processor.process_outputs(engine_outputs.outputs, time.time())
        self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    @contextmanager
    def measure_spec_decode(self) -> Iterator[SpecDecodeMetrics]:
        """Speculative-decoding figures of just the steps taken inside the block."""
        outer, self.spec_metrics = self.spec_metrics, SpecDecodeMetrics()
        try:
            yield self.spec_metrics
        finally:
            inner, self.spec_metrics = self.spec_metrics, outer
            self.spec_metrics.merge(inner)

    def shutdown(self) -> None:
        self.client.shutdown()
