"""Captured decode steps (DESIGN idea 6), the device-agnostic half (L3).

A uniform decode batch (every scheduled request computes exactly one token) of at most the
largest capture size is padded up to the next capture size and run through a step recorded
at warm-up: a CUDA graph on CUDA (worker/cuda_graphs.py), a torch.compile'd forward on CPU
(worker/compiled_cpu.py). Padding requests (prepare_batch's `padded_size`) write their K/V to
the null block, read nothing else, and are never sampled. Every other batch (prefill chunks,
spec-decode verification, larger batches) runs eagerly, as does every step with
--enforce-eager, a KV connector (its per-layer hooks are Python) or, on CPU, tensor
parallelism (collectives are not traced).

The dispatcher is the single source of truth: `padded_size(requests)` says whether a step is
captured and at which size; the runners trust it.
"""

from __future__ import annotations

import bisect
import logging
from typing import Protocol

import torch

from tokenbus.config import EngineConfig
from tokenbus.worker.input_batch import InputBuffers, PreparedBatch, ScheduledRequest, prepare_batch

logger = logging.getLogger(__name__)


class CaptureDispatcher:
    """Batch size -> the capture size it is padded to (None: run eagerly)."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = tuple(sizes)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, requests: list[ScheduledRequest]) -> int | None:
        num_reqs = len(requests)
        if not 0 < num_reqs <= self.max_size:
            return None
        if any(req.num_new_tokens != 1 or req.draft_token_ids for req in requests):
            return None  # mixed prefill, or spec-decode verification: eager
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]


class StepRunner(Protocol):
    """A device's way of recording and replaying the forward of one padded batch size."""

    def capture(self, size: int, batch: PreparedBatch) -> None:
        """Record the forward of `batch` (all padding, `size` tokens) over the persistent buffers."""

    def replay(self, size: int, batch: PreparedBatch) -> torch.Tensor:
        """Final hidden states [size, hidden] of `batch` (padded to `size`, attention
        metadata from prepare_for_replay)."""


class CapturedSteps:
    """Captures every size at warm-up (largest first) and replays the padded steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        runner: StepRunner,
        sizes: tuple[int, ...],
        buffers: InputBuffers,
        block_size: int,
        kv_caches: list[torch.Tensor],
    ) -> None:
        self.model = model
        self.runner = runner
        self.dispatcher = CaptureDispatcher(sizes)
        self.buffers = buffers
        self.block_size = block_size
        self.kv_caches = kv_caches

    def padded_size(self, requests: list[ScheduledRequest]) -> int | None:
        return self.dispatcher.padded_size(requests)

    def capture_all(self) -> None:
        """Largest first (a CUDA graph pool is sized by the first capture, smaller ones reuse it)."""
        for size in reversed(self.dispatcher.sizes):
            batch = prepare_batch(
                [], self.buffers, self.block_size, self.kv_caches, padded_size=size
            )
            batch.ctx.attn_metadata = self.model.attention_backend.prepare_for_capture(batch.ctx)
            self.runner.capture(size, batch)

    def run(self, batch: PreparedBatch) -> torch.Tensor:
        """Hidden states [padded_size, hidden] (rows past batch.num_tokens are padding)."""
        size = batch.padded_size
        batch.ctx.attn_metadata = self.model.attention_backend.prepare_for_replay(batch.ctx, size)
        return self.runner.replay(size, batch)


# On CPU the default capture sizes are not compiled: measured on the 2-core Xeon (docs/
# benchmarks.md, benchmarks/captured_decode.py), a compiled step was at most ~1.1x an eager one
# with the default GGUF weights (the quantized GEMV kernel is most of a step and compiling does
# not touch it), and it costs a compile at every start (tens of seconds cold, seconds warm).
# Listing --cudagraph-capture-sizes compiles them (dense fp32 weights measured faster at batch
# 1) — except for a model whose decode steps run their layers in C (model/native/
# decode_layer.c: 1.53x eager at batch 1, 1.24x at 16, against the compiled step's 0.90-0.99x).
CPU_CAPTURES_BY_DEFAULT = False


def capture_disabled_reason(
    config: EngineConfig, device: torch.device, model: torch.nn.Module | None = None
) -> str | None:
    """Why this engine runs every step eagerly (or, on CPU, on its C decode layers), or None."""
    if config.compilation.enforce_eager:
        return "--enforce-eager"
    if not config.compilation.cudagraph_capture_sizes:
        return "no capture sizes"
    if device.type == "cpu" and getattr(model, "decodes_in_c", False):
        return (
            "each decoder layer of a decode step runs in one C call, faster than a compiled step at "
            'every batch size measured (docs/benchmarks.md, "Captured decode steps")'
        )
    if device.type == "cpu" and not (
        config.compilation.capture_sizes_explicit or CPU_CAPTURES_BY_DEFAULT
    ):
        return "on CPU a compiled step runs only for sizes listed with --cudagraph-capture-sizes"
    if config.kv_transfer is not None:
        return "a KV connector is configured (its per-layer hooks run in Python)"
    if device.type == "cpu" and config.parallel.tensor_parallel_size > 1:
        return "tensor parallelism on CPU (gloo collectives are not compiled)"
    if device.type not in ("cpu", "cuda"):
        return f"no captured steps on {device.type}"
    return None


def make_captured_steps(
    config: EngineConfig,
    model: torch.nn.Module,
    buffers: InputBuffers,
    kv_caches: list[torch.Tensor],
    device: torch.device,
) -> CapturedSteps | None:
    """Capture every size now; None (eager steps) when disabled or, for default sizes, when
    capturing fails (one warning naming the cause). With explicit --cudagraph-capture-sizes a
    failure is an error."""
    reason = capture_disabled_reason(config, device, model)
    if reason is not None:
        logger.info("captured decode steps off: %s", reason)
        return None
    sizes = config.compilation.cudagraph_capture_sizes
    try:
        if device.type == "cuda":
            from tokenbus.worker.cuda_graphs import CudaGraphRunner

            runner: StepRunner = CudaGraphRunner(model, device)
        else:
            from tokenbus.worker.compiled_cpu import CompiledCpuRunner

            runner = CompiledCpuRunner(model, config)
        steps = CapturedSteps(model, runner, sizes, buffers, config.cache.block_size, kv_caches)
        steps.capture_all()
    except Exception as exc:  # noqa: BLE001 - any failure to capture/compile falls back or fails clearly
        what = "CUDA graph capture" if device.type == "cuda" else "compiling the decode step"
        if config.compilation.capture_sizes_explicit:
            raise RuntimeError(
                f"{what} failed for --cudagraph-capture-sizes {list(sizes)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        logger.warning(
            "%s failed, running every step eagerly (--enforce-eager silences this): %s: %s",
            what,
            type(exc).__name__,
            exc,
        )
        return None
    logger.info(
        "captured decode steps for batch sizes %s (%s)",
        list(sizes),
        "CUDA graphs" if device.type == "cuda" else "compiled on CPU",
    )
    return steps
