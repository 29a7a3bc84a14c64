"""LLMEngine: the synchronous front end used by the offline `LLM` (L4).

add_request → input processor (checks) → n>1 fan-out → EngineCore client → step → (output
processing) → outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from tokenbus.core.sched.spec_metrics import SpecDecodeMetrics
from tokenbus.engine.client_factory import start_engine
from tokenbus.engine.core_client import EngineCoreClient
from tokenbus.engine.input_processor import InputProcessor
from tokenbus.engine.output_processor import OutputKind, OutputProcessor
from tokenbus.engine.outputs import RequestOutput
from tokenbus.engine.parallel_sampling import register_children
from tokenbus.engine.setup import EngineSetup, create_engine_setup
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import LoRARequest, SchedulerStats
from tokenbus.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, setup: EngineSetup, tokenizer, client: EngineCoreClient) -> None:
        self.setup = setup
        self.config = setup.config
        self.tokenizer = tokenizer
        self.client = client
        self.input_processor = InputProcessor(
            tokenizer, setup.config, setup.eos_token_id, setup.arch, setup.extra_eos_token_ids
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
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        request = self.input_processor.make_request(
            request_id, prompt_token_ids, params, arrival_time, cache_salt, priority, lora_request
        )
        for child in register_children(self.output_processor, request, prompt, kind):
            self.client.add_request(child)

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
        self.input_processor.structured_validator.close()
