"""Runs one scheduled step on the model: update states → flatten inputs → forward → sample (L3)."""

from __future__ import annotations

import torch

from tokenbus.config import EngineConfig, ModelArch
from tokenbus.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.structured.manager import pad_bitmask_rows
from tokenbus.utils import cdiv
from tokenbus.worker.input_batch import InputBuffers, PreparedBatch, ScheduledRequest, prepare_batch
from tokenbus.worker.request_state import CachedRequestState
from tokenbus.worker.sampler import Sampler, to_token_logprobs
from tokenbus.worker.sampling_metadata import SamplingMetadata, SamplingRow


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, model: torch.nn.Module,
                 kv_caches: list[torch.Tensor], device: torch.device,
                 eos_token_id: int | None) -> None:
        self.config = config
        self.arch = arch
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = config.cache.block_size
        self.eos_token_id = eos_token_id
        sched = config.scheduler
        num_spec = config.speculative.num_speculative_tokens if config.speculative else 0
        self.buffers = InputBuffers(
            max_num_tokens=sched.max_num_batched_tokens,
            max_num_reqs=sched.max_num_seqs,
            max_blocks_per_req=cdiv(sched.max_model_len + num_spec, self.block_size) + 1,
            device=device,
        )
        # Unseeded rows share one generator seeded from the engine seed: runs are repeatable.
        default_generator = torch.Generator(device=device)
        default_generator.manual_seed(config.model.seed)
        self.sampler = Sampler(default_generator)
        self.requests: dict[str, CachedRequestState] = {}

    # ------------------------------------------------------------------ state updates
    def update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        # Preempted requests keep their state (and their generator, so a seeded request
        # samples the same stream after it resumes); their blocks come anew on resume.
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            generator = old.generator if old is not None else self._make_generator(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids), sampling_params=new.sampling_params,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=generator)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        scheduled = [
            ScheduledRequest(self.requests[req_id], num_new,
                             so.scheduled_spec_decode_tokens.get(req_id, []))
            for req_id, num_new in so.num_scheduled_tokens.items()
        ]
        batch = prepare_batch(scheduled, self.buffers, self.block_size, self.kv_caches)
        hidden = self.model(batch.input_ids, batch.ctx)
        sampled, logprobs = self._sample(batch, hidden, so)
        return self._make_output(batch, sampled, logprobs)

    def _sample(self, batch: PreparedBatch, hidden: torch.Tensor, so: SchedulerOutput):
        if not batch.sampling_requests:
            return [], []
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [rows, vocab] fp32
        rows = [self._sampling_row(batch.requests[i].state) for i in batch.sampling_requests]
        meta = SamplingMetadata.build(rows, logits.shape[-1], self.device)
        if so.grammar_bitmask is not None:
            row_req_ids = [batch.requests[i].state.req_id for i in batch.sampling_requests]
            bitmask = pad_bitmask_rows(so.grammar_bitmask, so.structured_output_request_ids,
                                       row_req_ids, so.grammar_bitmask.shape[1])
            meta.grammar_bitmask = bitmask.to(self.device)
        out = self.sampler(logits, meta)
        sampled = out.sampled_token_ids.tolist()
        logprobs = None
        if out.logprobs is not None:
            logprobs = to_token_logprobs(out.logprobs, [r.params.logprobs for r in rows])
        return sampled, logprobs

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        params = state.sampling_params
        stop_ids = list(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(self.eos_token_id)
        return SamplingRow(params=params, prompt_token_ids=state.prompt_token_ids,
                           output_token_ids=state.output_token_ids, generator=state.generator,
                           stop_ids_for_min_tokens=stop_ids)

    def _make_output(self, batch: PreparedBatch, sampled: list[int], logprobs) -> ModelRunnerOutput:
        req_ids = [r.state.req_id for r in batch.requests]
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        all_logprobs: list | None = [None] * len(req_ids) if logprobs is not None else None
        for row, batch_index in enumerate(batch.sampling_requests):
            token_id = sampled[row]
            state = batch.requests[batch_index].state
            state.append_output([token_id])
            sampled_token_ids[batch_index] = [token_id]
            if all_logprobs is not None and state.sampling_params.logprobs is not None:
                all_logprobs[batch_index] = [logprobs[row]]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids,
                                 logprobs=all_logprobs)
