"""Captured decode steps (docs/architecture.md), the device-agnostic half (L3).

A uniform decode batch (every scheduled request computes exactly one token) of at most the
largest capture size is padded up to the next capture size and run through a step recorded at
warm-up: a CUDA graph (worker/cuda_graphs.py). With speculative decoding of k drafts, so is a
verification batch, every request spanning 1 + k rows: a request with fewer drafts (or none)
gets dummy rows after its own tokens, up to MAX_DUMMY_PADDED_TOKENS in all. Padding requests
and dummy rows (prepare_batch's `padded`) write their K/V to the null block, read nothing a
real token needs, and are never sampled. Over a hybrid KV cache (core/kv/hybrid.py) every KV
group's slots and tables are padded so, and each group gets a static plan of its own tables
(ForwardContext.plan_attention). Every other batch (prefill chunks, larger batches, dummy rows
past that) runs eagerly, as does every step with --enforce-eager or a KV connector (its
per-layer hooks are Python); a draft model's single-token passes replay captured steps of their
own (spec_decode/draft_model.py). CPUs capture nothing: their decode steps run each decoder
layer in one C call (model/native/decode_layer.c), which beat a torch.compile'd step at every
batch size measured (benchmarks/captured_decode.py).

The dispatcher is the single source of truth: `shape(requests)` says whether a step is
captured and at which shape; the runners trust it.
"""

from __future__ import annotations

import bisect
import logging
from typing import Protocol

import torch

from tokenbus.config import EngineConfig
from tokenbus.model.moe import SparseMoeBlock
from tokenbus.worker.input_batch import (
    InputBuffers,
    PreparedBatch,
    ScheduledRequest,
    StepShape,
    prepare_batch,
)

logger = logging.getLogger(__name__)


# A verification step where some request has fewer drafts than k is captured with dummy rows
# for the missing ones (prepare_batch) only up to this many tokens. The bound is arithmetic,
# not a measurement: a bf16 step does about 1 FLOP per weight byte per token, and an H100's
# datasheet peaks (about 1,000 dense bf16 TFLOP/s over 3.35 TB/s) cross near 300, so a step
# of up to 256 tokens should still be bound by reading weights and its dummy rows cost little;
# past it they would cost compute, and the step runs eagerly. To be checked on a GPU.
MAX_DUMMY_PADDED_TOKENS = 256


class CaptureDispatcher:
    """A step's requests -> the captured shape they are padded to (None: run eagerly).

    Shapes: each capture size (requests) at each query length, 1 (decodes) and, with
    speculative decoding, 1 + k (verification steps: a request with fewer drafts than k, or
    none, gets dummy rows up to 1 + k), where size * query length fits `max_num_tokens`."""

    def __init__(
        self,
        sizes: tuple[int, ...],
        query_lens: tuple[int, ...] = (1,),
        max_num_tokens: int | None = None,
    ) -> None:
        self.sizes = tuple(sizes)
        self._sizes = {
            q: tuple(s for s in self.sizes if max_num_tokens is None or s * q <= max_num_tokens)
            for q in query_lens
        }

    @property
    def shapes(self) -> tuple[StepShape, ...]:
        return tuple(StepShape(size, q) for q, sizes in self._sizes.items() for size in sizes)

    def shape(self, requests: list[ScheduledRequest]) -> StepShape | None:
        # Decodes only: one known token a request, then its drafts (a prefill chunk has more).
        if not requests or any(r.num_new_tokens != 1 + len(r.draft_token_ids) for r in requests):
            return None
        longest = max(r.num_new_tokens for r in requests)
        q = min((q for q in self._sizes if q >= longest), default=None)
        shape = None if q is None else self._padded(len(requests), q)
        if shape is None:
            return None
        has_dummy_rows = any(r.num_new_tokens < q for r in requests)
        if has_dummy_rows and shape.num_tokens > MAX_DUMMY_PADDED_TOKENS:
            return None
        return shape

    def largest(self) -> tuple[StepShape, ...]:
        """The largest shape captured at each query length."""
        return tuple(StepShape(sizes[-1], q) for q, sizes in self._sizes.items() if sizes)

    def decode_shape(self, num_reqs: int) -> StepShape | None:
        """The shape a step of num_reqs single-token decodes is padded to (None: eager)."""
        return self._padded(num_reqs, 1) if num_reqs > 0 else None

    def _padded(self, num_reqs: int, query_len: int) -> StepShape | None:
        sizes = self._sizes.get(query_len, ())
        if not sizes or num_reqs > sizes[-1]:
            return None
        return StepShape(sizes[bisect.bisect_left(sizes, num_reqs)], query_len)


class StepRunner(Protocol):
    """A device's way of recording and replaying the forward of one padded step shape."""

    def capture(self, shape: StepShape, batch: PreparedBatch) -> None:
        """Record the forward of `batch` (all padding, of `shape`) over the persistent
        buffers."""

    def replay(self, shape: StepShape, batch: PreparedBatch) -> torch.Tensor:
        """Final hidden states [shape.num_tokens, hidden] of `batch` (padded to `shape`,
        attention metadata from prepare_for_replay)."""


class CapturedSteps:
    """Captures every shape at warm-up (largest first) and replays the padded steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        runner: StepRunner,
        sizes: tuple[int, ...],
        buffers: InputBuffers,
        block_size: int,
        kv_caches: list[torch.Tensor],
        query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.runner = runner
        self.dispatcher = CaptureDispatcher(sizes, query_lens, buffers.max_num_tokens)
        self.buffers = buffers
        self.block_size = block_size
        self.kv_caches = kv_caches

    def shape(self, requests: list[ScheduledRequest]) -> StepShape | None:
        return self.dispatcher.shape(requests)

    def capture_all(self) -> None:
        """Largest first (a CUDA graph pool is sized by the first capture, smaller ones reuse
        it)."""
        for shape in sorted(self.dispatcher.shapes, key=lambda s: s.num_tokens, reverse=True):
            batch = prepare_batch([], self.buffers, self.block_size, self.kv_caches, shape)
            batch.ctx.plan_attention(self.model.attention_backend.prepare_for_capture)
            self.runner.capture(shape, batch)

    def run(self, batch: PreparedBatch) -> torch.Tensor:
        """Hidden states [padded.num_tokens, hidden] (rows past batch.num_tokens are padding)."""
        shape = batch.padded
        backend = self.model.attention_backend
        batch.ctx.plan_attention(lambda ctx: backend.prepare_for_replay(ctx, shape.num_tokens))
        return self.runner.replay(shape, batch)


def capture_disabled_reason(
    config: EngineConfig, device: torch.device, model: torch.nn.Module | None = None
) -> str | None:
    """Why this engine runs every step eagerly (or, on CPU, on its C decode layers), or None."""
    if config.compilation.enforce_eager:
        return "--enforce-eager"
    if not config.compilation.cudagraph_capture_sizes:
        return "no capture sizes"
    if device.type == "cpu" and getattr(model, "decodes_in_c", False):
        return "each decoder layer of a decode step runs in one C call instead"
    if device.type != "cuda":
        return f"captured steps are CUDA graphs; none on {device.type}"
    if config.kv_transfer is not None:
        return "a KV connector is configured (its per-layer hooks run in Python)"
    if model is not None and getattr(model, "state_shapes", dict)():
        return "recurrent layers build their plan on the host each step"
    if model is not None and any(
        isinstance(m, SparseMoeBlock) and m.stacked is None for m in model.modules()
    ):
        return (
            "MoE layers that run their experts one by one read token counts on the host "
            "(the Triton backend runs them in grouped GEMMs instead)"
        )
    return None


def capture_query_lens(config: EngineConfig, model: torch.nn.Module) -> tuple[int, ...]:
    """The query lengths captured: 1 (decodes) and, with speculative decoding of k drafts a
    step, 1 + k (verification steps) on the Triton backend, whose static plans read K/V in
    place. (The torch path's static plan gathers each token's whole block table: 1 + k times a
    decode step's memory, which would make a failed capture, and eager steps, likelier.)"""
    spec = config.speculative
    backend = model.attention_backend
    if spec is None or backend.name != "triton":
        return (1,)
    verify = 1 + spec.num_speculative_tokens
    if verify > backend.max_capture_query_len():
        return (1,)
    return (1, verify)


def make_captured_steps(
    config: EngineConfig,
    model: torch.nn.Module,
    buffers: InputBuffers,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    query_lens: tuple[int, ...] | None = None,
    num_layers: int | None = None,
    role: str = "the model",
) -> CapturedSteps | None:
    """Capture every size now; None (eager steps) when disabled or, for default sizes, when
    capturing fails (one warning naming the cause). With explicit --cudagraph-capture-sizes a
    failure is an error, and sizes that cannot be captured here are said in a warning.

    `query_lens` default to capture_query_lens; `num_layers` runs only the first layers (a
    self-drafting proposer); `role` names the model in the log."""
    reason = capture_disabled_reason(config, device, model)
    if reason is not None:
        if config.compilation.capture_sizes_explicit:
            logger.warning("--cudagraph-capture-sizes has no effect: %s", reason)
        else:
            logger.info("captured decode steps off: %s", reason)
        return None
    sizes = config.compilation.cudagraph_capture_sizes
    try:
        from tokenbus.worker.cuda_graphs import CudaGraphRunner

        runner: StepRunner = CudaGraphRunner(model, device, num_layers)
        query_lens = query_lens or capture_query_lens(config, model)
        steps = CapturedSteps(
            model, runner, sizes, buffers, config.cache.block_size, kv_caches, query_lens
        )
        steps.capture_all()
    except Exception as exc:  # noqa: BLE001 - any failure to capture falls back or fails clearly
        if config.compilation.capture_sizes_explicit:
            raise RuntimeError(
                f"CUDA graph capture failed for --cudagraph-capture-sizes {list(sizes)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        logger.warning(
            "CUDA graph capture failed, running every step eagerly (--enforce-eager silences "
            "this): %s: %s",
            type(exc).__name__,
            exc,
        )
        return None
    logger.info(
        "captured steps of %s for batch sizes %s of %s query tokens a request (CUDA graphs)",
        role,
        list(sizes),
        " and ".join(map(str, query_lens)),
    )
    return steps
