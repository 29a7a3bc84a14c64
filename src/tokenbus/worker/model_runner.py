"""Runs one scheduled step on the model: update states → flatten inputs → forward → sample
(or verify drafts) → propose next drafts (L3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus.config import EngineConfig
from tokenbus.core.kv.hybrid import engine_kv_groups
from tokenbus.core.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    PendingOutput,
    ReadyOutput,
)
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.kv_transfer.base import KVConnectorWorker
from tokenbus.model_arch import ModelArch
from tokenbus.protocol import TokenLogprobs
from tokenbus.sampling_params import SamplingParams
from tokenbus.structured.manager import bitmask_rows, pad_bitmask_rows
from tokenbus.worker.captured_step import CapturedSteps, make_captured_steps
from tokenbus.worker.input_batch import (
    InputBuffers,
    PreparedBatch,
    ScheduledRequest,
    max_blocks_per_req,
    prepare_batch,
)
from tokenbus.worker.lora_slots import LoRAAdapters, StepRun
from tokenbus.worker.pooling import compute_pooled
from tokenbus.worker.prompt_logprobs import compute_prompt_logprobs
from tokenbus.worker.request_state import CachedRequestState
from tokenbus.worker.sampler import (
    LogprobsTensors,
    Sampler,
    pack_logprobs,
    to_token_logprobs,
    unpack_logprobs,
)
from tokenbus.worker.sampling_metadata import SamplingMetadata, SamplingRow, to_device
from tokenbus.worker.spec_decode import (
    RejectionSampler,
    SpecDecodeMetadata,
    draft_cap,
    expand_sampling_rows,
    make_proposer,
)
from tokenbus.worker.spec_decode.draft_model import DraftModel
from tokenbus.worker.state_pool import RequestStates


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        eos_token_id: int | None,
        kv_connector: KVConnectorWorker | None = None,
        draft: DraftModel | None = None,
    ) -> None:
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
            max_num_reqs=max(sched.max_num_seqs, config.compilation.max_capture_size),
            max_blocks_per_req=max_blocks_per_req(config),
            device=device,
            kv_groups=engine_kv_groups(config, arch),
            recurrent_layers=arch.recurrent_layers,
        )
        # Recurrent layers' state rows (worker/state_pool.py); None: every layer attends.
        self.request_states = (
            RequestStates(kv_caches[i] for i in arch.recurrent_layers)
            if arch.recurrent_layers
            else None
        )
        # Unseeded rows share one generator seeded from the engine seed: runs are repeatable.
        default_generator = torch.Generator(device=device)
        default_generator.manual_seed(config.model.seed)
        self.sampler = Sampler(default_generator)
        self.rejection_sampler = RejectionSampler(default_generator)
        self.num_spec_tokens = num_spec
        self.proposer = make_proposer(config, arch, model, kv_caches, device, draft)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_connector = kv_connector
        self.captured: CapturedSteps | None = None  # set by capture_model()
        # Async scheduling: the last step's sampled ids on the device, and each sampling
        # request's row in them (the next step's decodes feed these tokens before they are
        # read back).
        self.keeps_samples = config.scheduler.async_scheduling
        self.last_samples: tuple[torch.Tensor, dict[str, int]] | None = None
        self.lora = LoRAAdapters(model, arch, config.lora) if config.lora is not None else None

    def capture_model(self) -> None:
        """Record the decode step of every capture size (warm-up, after the KV cache exists),
        then the proposer's own forwards; steps stay eager when capture is off or fails
        (captured_step.make_captured_steps)."""
        with torch.inference_mode():
            self.captured = make_captured_steps(
                self.config, self.model, self.buffers, self.kv_caches, self.device
            )
            if self.captured is not None and self.proposer is not None:
                self.proposer.capture_model(self.config, self.device)

    # ------------------------------------------------------------------ state updates
    def update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if self.request_states is not None:  # rows back before new requests take them
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                self.request_states.release(req_id)
        # Preempted requests keep their state (and their generator, so a seeded request
        # samples the same stream after it resumes); their blocks come anew on resume.
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            generator = (
                old.generator if old is not None else self._make_generator(new.sampling_params.seed)
            )
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
                lora_id=new.lora_id,
                lora_path=new.lora_path,
                group_block_ids=[list(ids) for ids in new.group_block_ids],
                state_row=self._start_state(new.req_id, new.num_computed_tokens),
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            for table, new_ids in zip(state.group_block_ids, cached.new_group_block_ids):
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _start_state(self, req_id: str, num_computed_tokens: int) -> int:
        """A new request's zeroed row of the recurrent states (-1 without recurrent layers).
        Its state is made of every token before the step's: it must start from token 0."""
        if self.request_states is None:
            return -1
        if num_computed_tokens:
            raise ValueError(
                f"request {req_id!r} starts at token {num_computed_tokens}: a recurrent "
                "layer's state is built from the first token (prefix caching and KV "
                "transfer cannot serve this model)"
            )
        return self.request_states.start(req_id)

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    # ------------------------------------------------------------------ the step
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingOutput:
        """Hand the step to the device. What needs its sampled ids on the host (the output,
        next step's drafts) waits for `.result()`, so the caller may prepare the next step
        while the device runs this one."""
        self.update_states(so)
        connector = self.kv_connector
        if connector is None:
            return self._launch(so)
        # Loads land before any layer reads the pool; saves end before its blocks may change.
        connector.bind_connector_metadata(so.kv_connector_metadata)
        connector.start_load_kv()
        output = self._launch(so).result()
        connector.wait_for_save()
        kv_output = connector.build_output(so.finished_req_ids)
        if kv_output is not None:
            if output is EMPTY_MODEL_RUNNER_OUTPUT:
                output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            output.kv_connector_output = kv_output
        return ReadyOutput(output)

    def _launch(self, so: SchedulerOutput) -> PendingOutput:
        if so.total_num_scheduled_tokens == 0:
            return ReadyOutput(EMPTY_MODEL_RUNNER_OUTPUT)
        scheduled = [
            ScheduledRequest(
                self.requests[req_id],
                num_new,
                so.scheduled_spec_decode_tokens.get(req_id, []),
                pools=self.requests[req_id].sampling_params.pooling is not None,
            )
            for req_id, num_new in so.num_scheduled_tokens.items()
        ]
        with_lora = any(req.state.lora_id for req in scheduled)
        padded = (
            self.captured.shape(scheduled)
            if self.captured is not None and not with_lora  # adapters: the eager side path
            else None
        )
        batch = prepare_batch(scheduled, self.buffers, self.block_size, self.kv_caches, padded)
        unread_tokens = self._feed_unread_inputs(batch) if batch.unread_inputs else None
        batch.ctx.kv_connector = self.kv_connector
        if self.lora is not None:
            runs = [
                StepRun(req.state.lora_id, req.state.lora_path, req.num_new_tokens)
                for req in batch.requests
            ]
            self.lora.set_batch(runs, batch.input_ids.shape[0])
        if padded is not None:
            hidden = self.captured.run(batch)[: batch.num_tokens]  # padding rows are never sampled
        else:
            batch.ctx.plan_attention(self.model.attention_backend.build_metadata)
            hidden = self.model(batch.input_ids, batch.ctx)
        return _LaunchedStep(
            self,
            batch,
            self._sample(batch, hidden, so, unread_tokens),
            compute_prompt_logprobs(self.model, hidden, batch),
            compute_pooled(hidden, batch),
        )

    def _sample(
        self,
        batch: PreparedBatch,
        hidden: torch.Tensor,
        so: SchedulerOutput,
        unread_tokens: torch.Tensor | None = None,
    ) -> _Samples:
        """Tokens (and logprobs) per sampling request: one, or accepted drafts + one.
        `unread_tokens`: the tokens batch.unread_inputs fed, on the device."""
        if not batch.sampling_requests:
            return _Samples.on_host([], [], None, [])
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [rows, vocab] fp32
        states = [batch.requests[i].state for i in batch.sampling_requests]
        drafts = [batch.requests[i].draft_token_ids for i in batch.sampling_requests]
        verifies = any(drafts)
        rows = [self._sampling_row(state) for state in states]
        unread = None
        if unread_tokens is not None:
            # A decode fed an unread token has one output more than its state holds.
            row_of = {index: row for row, index in enumerate(batch.sampling_requests)}
            unread_rows = [row_of[index] for _, index in batch.unread_inputs]
            for row in unread_rows:
                rows[row].num_unread_outputs = 1
            unread = (unread_rows, unread_tokens)  # the penalties count them
        if verifies:
            rows = expand_sampling_rows(rows, drafts)  # one row per position
        meta = SamplingMetadata.build(rows, logits.shape[-1], self.device, unread)
        if so.grammar_bitmask is not None:
            constrained = bitmask_rows(so.grammar_bitmask)
            bitmask = pad_bitmask_rows(
                constrained,
                so.structured_output_request_ids,
                [state.req_id for state in states],
                constrained.shape[1],
                batch.num_logits_per_request,
            )
            meta.grammar_bitmask = to_device(bitmask, self.device)
        num_logprobs = [row.params.logprobs for row in rows]
        if verifies:
            spec = SpecDecodeMetadata.build(drafts, self.device)
            out = self.rejection_sampler(logits, meta, spec)
            return _Samples.on_host(out.token_ids, spec.first_rows, out.logprobs, num_logprobs)
        out = self.sampler(logits, meta)
        if self.keeps_samples:
            rows_of = {state.req_id: row for row, state in enumerate(states)}
            self.last_samples = (out.sampled_token_ids, rows_of)
        return _Samples.on_device(out.sampled_token_ids, out.logprobs, num_logprobs)

    def _feed_unread_inputs(self, batch: PreparedBatch) -> torch.Tensor:
        """Decodes whose input token the last step sampled and nobody has read yet (async
        scheduling): copied into input_ids on the device, from that step's sampled ids.
        Returns those tokens (Long[len(batch.unread_inputs)], on the device)."""
        if self.last_samples is None:
            raise RuntimeError("a decode's input token is unknown, and no step sampled it")
        sampled, rows_of = self.last_samples
        staged = self.buffers.staged["unread_inputs"]
        count = len(batch.unread_inputs)
        for j, (row, index) in enumerate(batch.unread_inputs):
            staged.np[0, j] = row
            staged.np[1, j] = rows_of[batch.requests[index].state.req_id]
        rows = self.buffers.device_view("unread_inputs", 2)
        tokens = sampled[rows[1, :count]]
        batch.input_ids[rows[0, :count]] = tokens
        return tokens

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        return SamplingRow(
            params=state.sampling_params,
            prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            generator=state.generator,
            stop_ids_for_min_tokens=self._stop_token_ids(state.sampling_params),
        )

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        stop_ids = list(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(self.eos_token_id)
        return stop_ids

    def _make_output(
        self,
        batch: PreparedBatch,
        sampled: list[list[int]],
        logprobs: list[list[TokenLogprobs] | None] | None,
    ) -> ModelRunnerOutput:
        req_ids = [r.state.req_id for r in batch.requests]
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        all_logprobs: list | None = [None] * len(req_ids) if logprobs is not None else None
        for row, batch_index in enumerate(batch.sampling_requests):
            batch.requests[batch_index].state.append_output(sampled[row])
            sampled_token_ids[batch_index] = sampled[row]
            if all_logprobs is not None:
                all_logprobs[batch_index] = logprobs[row]
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled_token_ids, logprobs=all_logprobs
        )

    def _propose(self, batch: PreparedBatch, sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for next step, per request in batch order (after the step's tokens were
        appended)."""
        emitted: list[list[int] | None] = [None] * len(batch.requests)  # None: did not sample
        for row, batch_index in enumerate(batch.sampling_requests):
            emitted[batch_index] = sampled[row]
        max_model_len = self.config.scheduler.max_model_len
        caps = [
            draft_cap(
                req.state,
                self.num_spec_tokens,
                max_model_len,
                self._stop_token_ids(req.state.sampling_params),
                tokens,
            )
            for req, tokens in zip(batch.requests, emitted)
        ]
        return self.proposer.propose(batch, [tokens is not None for tokens in emitted], caps)


@dataclass
class _Samples:
    """A step's sampled tokens, one list per sampling request. Plain sampling leaves them on
    the device (on CUDA, copying into pinned memory behind the step) until `read()`; a
    verification has read its accepted tokens already."""

    token_ids: list[list[int]] | None  # on the host already
    host_ids: torch.Tensor | None  # Long[rows] (CUDA: a pinned copy, complete at `copied`)
    copied: torch.cuda.Event | None
    first_rows: list[int]  # each request's first row in `logprobs`
    # A verification's, or plain sampling's pack_logprobs rows (on CUDA in pinned memory).
    logprobs: LogprobsTensors | torch.Tensor | None
    num_logprobs: list[int | None]  # per row: what its request asked for

    @classmethod
    def on_host(cls, token_ids, first_rows, logprobs, num_logprobs) -> _Samples:
        return cls(token_ids, None, None, first_rows, logprobs, num_logprobs)

    @classmethod
    def on_device(cls, ids: torch.Tensor, logprobs, num_logprobs) -> _Samples:
        host, copied = ids, None
        if logprobs is not None:  # one tensor, read with the ids
            logprobs = pack_logprobs(logprobs)
        if ids.device.type == "cuda":
            # The logprobs too: reading them from the device would wait for every step
            # launched after this one.
            host = _pinned_copy(ids)
            if logprobs is not None:
                logprobs = _pinned_copy(logprobs)
            copied = torch.cuda.Event()
            copied.record()
        return cls(None, host, copied, list(range(len(ids))), logprobs, num_logprobs)

    def read(self) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """The tokens (waiting for their step) and their logprobs, per sampling request."""
        tokens = self.token_ids
        if tokens is None:
            if self.copied is not None:
                self.copied.synchronize()  # this step's copy only, not the steps launched after
            tokens = [[t] for t in self.host_ids.tolist()]
        if self.logprobs is None:
            return tokens, None
        if isinstance(self.logprobs, torch.Tensor):
            per_row = unpack_logprobs(self.logprobs, self.num_logprobs)
        else:
            per_row = to_token_logprobs(self.logprobs, self.num_logprobs)
        return tokens, [
            None if per_row[first] is None else per_row[first : first + len(t)]
            for first, t in zip(self.first_rows, tokens)
        ]


def _pinned_copy(device: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that `device` is copied into behind the work queued so far."""
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    return host.copy_(device, non_blocking=True)


@dataclass
class _LaunchedStep:
    """A step on the device; `result()` reads its tokens back and finishes the output."""

    runner: ModelRunner
    batch: PreparedBatch
    samples: _Samples
    prompt_logprobs: tuple[list, list[int]] | None
    pooled: list[list[float] | None] | None

    @torch.inference_mode()
    def result(self) -> ModelRunnerOutput:
        runner, batch = self.runner, self.batch
        sampled, logprobs = self.samples.read()
        output = runner._make_output(batch, sampled, logprobs)
        if self.prompt_logprobs is not None:
            output.prompt_logprobs, output.prompt_logprobs_start = self.prompt_logprobs
        output.pooled = self.pooled
        if runner.proposer is not None:
            output.spec_token_ids = runner._propose(batch, sampled)
        return output
