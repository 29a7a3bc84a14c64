"""Draft-model proposer: a small model, or the target's own first N layers, drafts k tokens (L3).

Each step, after the target sampled, the draft model runs:

1. a catch-up pass over the tokens the step made final, ending at each request's newly sampled
   token; its logits there give draft 1;
2. k - 1 decode passes, each feeding the previous draft (on the device: the drafts are read
   back once, after the last pass).

On CUDA its single-token passes (the decode passes, and self-speculation's catch-up) replay
CUDA graphs of their own once the target's steps are captured (worker/captured_step.py).

Its KV lives in paged tensors indexed by the target's block tables (same block ids, same
slots). A separate draft model owns its own layer tensors, so its catch-up pass feeds every
token the target computed this step (prefill chunks too) and its KV holds wherever the
target's does, prefix-cache hits included. Self-speculation (the target's first N layers and
head) shares the target's tensors: the target already wrote layers < N for every token it
computed, identically, so the catch-up pass feeds only the new token.

Draft KV past the verified tokens is scratch: the scheduler reserves k lookahead slots for it,
never caches it, and the target rewrites those positions before it reads them.
Drafts are greedy (argmax), so q is one-hot and the rejection sampler needs no probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus.config import EngineConfig
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch
from tokenbus.worker.captured_step import CapturedSteps, make_captured_steps
from tokenbus.worker.input_batch import (
    InputBuffers,
    PreparedBatch,
    ScheduledRequest,
    max_blocks_per_req,
    prepare_batch,
)


@dataclass
class _CatchUpView:
    """What prepare_batch reads of a request state, with the draft model's computed count."""

    num_computed_tokens: int
    token_ids: list[int]  # the state's own list (not copied)
    block_ids: list[int]
    batch_index: int  # the request's index in the target step's batch
    lora_id: int = 0  # no adapter: --enable-lora runs without speculative decoding
    # none: speculative decoding runs on one block table (core/kv/hybrid.engine_kv_groups)
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        num_layers: int | None,
        shares_target_kv: bool,
        num_speculative_tokens: int,
        block_size: int,
        buffers: InputBuffers,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_layers = num_layers  # None: all of the draft model's layers
        self.shares_target_kv = shares_target_kv
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.buffers = buffers  # the draft's own: the target's batch tensors view the runner's
        # Its single-token passes replayed as CUDA graphs, once the target's steps are captured.
        self.captured: CapturedSteps | None = None

    def capture_model(self, config: EngineConfig, device: torch.device) -> None:
        """Its single-token passes as the target's decode steps, at the same sizes (a
        separate draft model's catch-up pass, of several tokens a request, stays eager). Their
        graphs' memory, a draft's activations for at most the largest size, is not taken out
        of the KV budget as the target's is."""
        self.captured = make_captured_steps(
            config,
            self.model,
            self.buffers,
            self.kv_caches,
            device,
            query_lens=(1,),
            num_layers=self.num_layers,
            role="the draft model",
        )

    def propose(
        self, batch: PreparedBatch, sampled: list[bool], caps: list[int]
    ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in batch.requests]
        rows, first = self._catch_up(batch, sampled, caps)  # draft 1 of each row, on the device
        if not rows:
            return drafts
        # Every row runs each decode pass, so a pass's output is the next one's input where it
        # lies, on the device; a row past its cap runs as padding (the null block) and its
        # drafts are dropped. The drafts come back in one read, after the last pass.
        states = [batch.requests[i].state for i in rows]
        passes = [first]
        for j in range(1, max(caps[i] for i in rows)):
            # Draft j (0-based) is fed at position num_tokens - 1 + j and predicts draft j + 1.
            passes.append(
                self._decode(
                    passes[-1],
                    [s.num_tokens - 1 + j if caps[i] > j else None for i, s in zip(rows, states)],
                    [s.block_ids for s in states],
                )
            )
        tokens = torch.stack(passes, dim=1).tolist()  # [rows, passes]
        for index, row_tokens in zip(rows, tokens):
            drafts[index] = row_tokens[: caps[index]]
        return drafts

    def _catch_up(
        self, batch: PreparedBatch, sampled: list[bool], caps: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """(each row's batch index, its draft 1 [rows] on the device): rows end at a newly
        sampled token (those with caps of 0 too; their drafts are dropped)."""
        views = []
        for index, req in enumerate(batch.requests):
            state = req.state
            if self.shares_target_kv:
                if caps[index] > 0:  # only the new token: the target wrote the rest
                    views.append(
                        (
                            _CatchUpView(
                                state.num_tokens - 1, state.token_ids, state.block_ids, index
                            ),
                            1,
                        )
                    )
                continue
            # Every token the target made final this step, and the new token if one was sampled.
            end = (
                state.num_tokens
                if sampled[index]
                else state.num_computed_tokens + req.num_new_tokens
            )
            start = state.num_computed_tokens
            views.append(
                (_CatchUpView(start, state.token_ids, state.block_ids, index), end - start)
            )
        if not views:
            return [], torch.empty(0)
        requests = [ScheduledRequest(view, n, []) for view, n in views]
        # Self-speculation feeds one token a request: a captured step where one was recorded.
        padded = self.captured.shape(requests) if self.captured is not None else None
        inputs = prepare_batch(requests, self.buffers, self.block_size, self.kv_caches, padded)
        rows = [inputs.requests[r].state.batch_index for r in inputs.sampling_requests]
        return rows, self._greedy(inputs)

    def _decode(
        self, tokens: torch.Tensor, positions: list[int | None], block_ids: list[list[int]]
    ) -> torch.Tensor:
        """One token a row (`tokens`, on the device) at the given positions -> the draft's
        argmax after each. A row at position None is padding, as are the rows past them up to
        a captured size: position 0, slot 0 of the null block, reading only that block."""
        n, bs, buf = len(positions), self.block_size, self.buffers
        buf.wait_for_copies()
        padded = self.captured.dispatcher.decode_shape(n) if self.captured is not None else None
        size = n if padded is None else padded.num_reqs
        # A captured step reads the tables at their full width (a shape fixed at capture).
        width = max(len(b) for b in block_ids) if padded is None else buf.block_table.shape[1]
        seq_lens = []
        for row in range(size):
            pos = positions[row] if row < n else None
            if pos is None:
                buf.block_table[row, :width] = 0
                buf.slot_mapping[row] = buf.positions[row] = 0
                seq_lens.append(1)
                continue
            blocks = block_ids[row]
            buf.block_table[row, : len(blocks)] = blocks
            buf.slot_mapping[row] = blocks[pos // bs] * bs + pos % bs  # slot of the fed token
            buf.positions[row] = pos
            seq_lens.append(pos + 1)
        buf.seq_lens[:size] = seq_lens
        buf.query_start_loc[: size + 1] = range(size + 1)
        buf.logits_indices[:n] = range(n)
        ctx = ForwardContext(
            positions=buf.device_view("positions", size),
            slot_mapping=buf.device_view("slot_mapping", size),
            kv_caches=self.kv_caches,
            block_size=bs,
            query_start_loc=list(range(size + 1)),
            seq_lens=seq_lens,
            seq_lens_t=buf.device_view("seq_lens", size),
            block_tables=buf.device_view("block_table", size, width),
            num_decodes=size,
            query_start_loc_t=buf.device_view("query_start_loc", size + 1),
        )
        input_ids = tokens
        if padded is not None:  # the tokens go where the recorded graph reads them
            input_ids = buf.staged["input_ids"].device[:size]
            input_ids[:n].copy_(tokens)
            input_ids[n:].zero_()
        batch = PreparedBatch(
            requests=[],
            input_ids=input_ids,
            ctx=ctx,
            logits_indices=buf.device_view("logits_indices", n),
            sampling_requests=[],
            num_logits_per_request=[],
            num_tokens=n,
            padded=padded,
        )
        return self._greedy(batch)

    def _greedy(self, batch: PreparedBatch) -> torch.Tensor:
        """The argmax token after each of the batch's logits rows, left on the device."""
        if batch.padded is not None:
            hidden = self.captured.run(batch)
        else:
            batch.ctx.plan_attention(self.model.attention_backend.build_metadata)
            hidden = self.model(batch.input_ids, batch.ctx, num_layers=self.num_layers)
        return self.model.compute_logits(hidden[batch.logits_indices]).argmax(-1)


@dataclass(frozen=True)
class DraftModel:
    """A separate draft model (speculative_config.model), sharded like the target."""

    model: torch.nn.Module
    arch: ModelArch  # its whole shape; a rank's share is model.tp.shard_arch(arch)


def load_draft_model(
    config: EngineConfig, arch: ModelArch, target: torch.nn.Module, device: torch.device
) -> DraftModel | None:
    """The separate draft model speculative_config.model names, or None (no speculation,
    n-gram, self-speculation). Loaded with the target, before the KV cache is sized: its
    weights are in use then, and its own cache holds every block id the target's does, so its
    layers count in each block's bytes (worker/kv_cache.determine_num_blocks)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    model, draft_arch = _load_draft_model(
        spec.model,
        arch,
        config.scheduler.max_model_len,
        target.embed_tokens.dtype,
        device,
        config.model.attention_backend,
        target.tp,
    )
    return DraftModel(model, draft_arch)


def make_draft_model_proposer(
    config: EngineConfig,
    arch: ModelArch,
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    draft: DraftModel | None,
) -> DraftModelProposer:
    """Self-speculation ("draft_layers" only) or a separate draft model ("model": `draft`, from
    load_draft_model)."""
    spec = config.speculative
    sched = config.scheduler
    buffers = InputBuffers(
        max_num_tokens=sched.max_num_batched_tokens + sched.max_num_seqs,  # + one new token each
        max_num_reqs=max(sched.max_num_seqs, config.compilation.max_capture_size),
        max_blocks_per_req=max_blocks_per_req(config),
        device=device,
    )
    common = dict(
        num_speculative_tokens=spec.num_speculative_tokens,
        block_size=config.cache.block_size,
        buffers=buffers,
    )
    if spec.model is None:
        num_layers = _check_draft_layers(
            spec.draft_layers,
            arch.num_hidden_layers - 1,
            f"(self-speculation uses fewer than the target's {arch.num_hidden_layers})",
        )
        return DraftModelProposer(model, kv_caches, num_layers, shares_target_kv=True, **common)
    assert draft is not None, "load_draft_model loads a separate draft model with the target"
    num_layers = None
    if spec.draft_layers is not None:
        num_layers = _check_draft_layers(
            spec.draft_layers,
            draft.arch.num_hidden_layers,
            f"(the draft model has {draft.arch.num_hidden_layers})",
        )
    from tokenbus.worker.kv_cache import allocate_kv_caches

    num_blocks = kv_caches[0].shape[1]  # [2, num_blocks, block_size, Hkv, D]
    # The target's pool dtype (--kv-cache-dtype) too: its block count was sized for that.
    draft_kv = allocate_kv_caches(
        model.tp.shard_arch(draft.arch),
        num_blocks,
        config.cache.block_size,
        kv_caches[0].dtype,
        device,
    )
    return DraftModelProposer(draft.model, draft_kv, num_layers, shares_target_kv=False, **common)


def _check_draft_layers(draft_layers: int, max_layers: int, why: str) -> int:
    if not 1 <= draft_layers <= max_layers:
        raise ValueError(
            f"speculative_config.draft_layers must be in [1, {max_layers}] {why}, "
            f"got {draft_layers}"
        )
    return draft_layers


def _load_draft_model(
    name: str,
    target_arch: ModelArch,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    tp: TensorParallel,
) -> tuple[torch.nn.Module, ModelArch]:
    """Sharded like the target (the same ranks run both)."""
    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.worker.model_builder import load_model

    try:
        source = resolve_model(name)
        draft_arch = load_arch(source)
    except ValueError as exc:
        raise ValueError(f"speculative_config.model (the draft model): {exc}") from None
    if draft_arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model {name!r} has a vocabulary of "
            f"{draft_arch.vocab_size} tokens but the target has {target_arch.vocab_size}; "
            "a draft model must share the target's vocabulary"
        )
    if draft_arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft model {name!r} supports "
            f"{draft_arch.max_position_embeddings} positions, "
            f"fewer than max_model_len={max_model_len}; "
            "lower --max-model-len"
        )
    return load_model(source, draft_arch, dtype, device, attention_backend, tp), draft_arch
