"""Attention backends: how a step's attention metadata is built from its ForwardContext (L2).

The worker calls a backend before every forward and stores the result in ctx.attn_metadata;
the attention layers only read it (model/attention.py). Three entry points:

- build_metadata(ctx): an eager step of any shape (ragged decodes, prefill chunks, drafts).
- prepare_for_capture(ctx): a dummy uniform batch over the worker's persistent buffers, all of
  it padding, at warm-up: the static plan a captured graph of that size is recorded with.
- prepare_for_replay(ctx, padded_size): a real uniform batch padded to a captured size over the
  same buffers: the same static plan, so the recorded graph reads this step's inputs.

A uniform batch has R requests of q_len query tokens each (decodes: 1; spec-decode
verification: 1 + k drafts), num_tokens = R * q_len; its padding requests come after the real
ones with seq_len q_len, zero block tables and slots in block 0, so they read and write only
the null block.
"""

from __future__ import annotations

import logging
import os

import torch

from tokenbus.config import ATTENTION_BACKENDS
from tokenbus.model.attention import (
    NATIVE_MAX_QUERY_LEN,
    AttentionPlan,
    TorchDecodePlan,
    build_attention_plan,
)
from tokenbus.model.batch_invariant import row_invariant_plan
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.native import (
    KERNEL_KV_DTYPES,
    NativeBuildError,
    PagedAttentionKernel,
    load_paged_attention,
)

logger = logging.getLogger(__name__)


def select_attention_kernel(
    backend: str, device: torch.device, dtype: torch.dtype
) -> PagedAttentionKernel | None:
    """The native kernel for "native", and for "auto" on CPU in fp32/bf16 when it builds; else
    None (the torch path). "native" where it cannot run is an error naming the reason."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend in ("torch", "triton"):  # triton: attention_backend.TritonAttentionBackend
        return None
    supported = device.type == "cpu" and dtype in KERNEL_KV_DTYPES
    if not supported:
        if backend == "native":
            raise ValueError(
                f"attention_backend 'native' runs on CPU in float32 or bfloat16, "
                f"not {device.type} {dtype}"
            )
        return None
    try:
        return load_paged_attention()
    except NativeBuildError as exc:
        if backend == "native":
            raise ValueError(f"attention_backend 'native' is unavailable: {exc}") from exc
        logger.warning("native paged attention unavailable (%s); using the torch path", exc)
        return None


class AttentionBackend:
    """The entry points; subclasses choose the kernels (`kernel`) and the static plan."""

    name: str

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # of the activations (masks are built in it)
        # (num_tokens, q_len) -> the token -> request map of a static plan, made once at capture
        # (a captured graph reads it at a fixed address).
        self._token_requests: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def kernel(self) -> PagedAttentionKernel | None:
        return None

    def build_metadata(self, ctx: ForwardContext) -> AttentionPlan:
        return build_attention_plan(ctx, self.dtype, self.kernel)

    def max_capture_query_len(self) -> int:
        """The longest uniform q_len a static plan takes."""
        return NATIVE_MAX_QUERY_LEN

    def prepare_for_capture(self, ctx: ForwardContext) -> TorchDecodePlan:
        num_reqs, q_len = self._uniform_shape(ctx)
        key = (ctx.num_tokens, q_len)
        if key not in self._token_requests:
            device = ctx.block_tables.device
            self._token_requests[key] = torch.arange(num_reqs, device=device).repeat_interleave(
                q_len
            )
        return self._static_plan(ctx, q_len)

    def prepare_for_replay(self, ctx: ForwardContext, padded_size: int) -> TorchDecodePlan:
        if ctx.num_tokens != padded_size:
            raise ValueError(
                f"a replayed batch must be padded to {padded_size} tokens, got {ctx.num_tokens}"
            )
        _, q_len = self._uniform_shape(ctx)
        if (padded_size, q_len) not in self._token_requests:
            raise ValueError(f"no step was captured for {padded_size} tokens of q_len {q_len}")
        return self._static_plan(ctx, q_len)

    def _uniform_shape(self, ctx: ForwardContext) -> tuple[int, int]:
        num_reqs = ctx.num_reqs
        q_len = ctx.num_tokens // max(num_reqs, 1)
        starts = ctx.query_start_loc
        if num_reqs == 0 or any(starts[r + 1] - starts[r] != q_len for r in range(num_reqs)):
            raise ValueError(
                "a static attention plan needs a uniform batch (every request the same q_len)"
            )
        if q_len > self.max_capture_query_len():
            raise ValueError(
                f"a static attention plan takes q_len <= {self.max_capture_query_len()}, "
                f"got {q_len}"
            )
        return num_reqs, q_len

    def _static_plan(self, ctx: ForwardContext, q_len: int) -> TorchDecodePlan:
        raise NotImplementedError

    def _torch_plan(self, ctx: ForwardContext, q_len: int) -> TorchDecodePlan:
        return TorchDecodePlan(
            ctx.num_tokens,
            ctx.block_tables,
            self._token_requests[(ctx.num_tokens, q_len)],
            ctx.positions,
        )


class TorchAttentionBackend(AttentionBackend):
    """The portable torch path (CPU and CUDA)."""

    name = "torch"

    def _static_plan(self, ctx: ForwardContext, q_len: int) -> TorchDecodePlan:
        return self._torch_plan(ctx, q_len)


class NativeAttentionBackend(AttentionBackend):
    """The native CPU kernel (model/native/paged_attention.c) for short queries, its flash path
    (or SDPA) for long prefill chunks; `row_invariant` (--batch-invariant): its decode path for
    every query (model/batch_invariant.py)."""

    name = "native"

    def __init__(
        self, dtype: torch.dtype, kernel: PagedAttentionKernel, row_invariant: bool = False
    ) -> None:
        super().__init__(dtype)
        self._kernel = kernel
        self.row_invariant = row_invariant

    @property
    def kernel(self) -> PagedAttentionKernel:
        return self._kernel

    def build_metadata(self, ctx: ForwardContext) -> AttentionPlan:
        if self.row_invariant:
            return row_invariant_plan(ctx, self._kernel, self.dtype)
        return super().build_metadata(ctx)

    def _static_plan(self, ctx: ForwardContext, q_len: int) -> TorchDecodePlan:
        # Only CUDA graphs capture, and the native kernel runs on CPU: any static plan it is
        # asked for is the portable one.
        return self._torch_plan(ctx, q_len)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels (model/triton_attention.py) for every request of a step: decodes,
    prefill chunks and spec-decode verifications, K/V read in place. The default on CUDA."""

    name = "triton"
    MIN_SPLIT_CONTEXT = 256  # eager decodes split their keys only past this many

    def build_metadata(self, ctx: ForwardContext):
        from tokenbus.model.triton_attention import TritonPlan, decode_splits

        starts = ctx.query_start_loc
        max_query_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        device = ctx.block_tables.device
        split = 1
        # Only a decode-only step splits: beside a prefill chunk the GPU is busy anyway, and
        # the partials ([tokens, heads, splits, D + 2] fp32) would be sized by every token.
        decode_only = ctx.num_decodes == ctx.num_reqs
        if decode_only and max(ctx.seq_lens, default=0) > self.MIN_SPLIT_CONTEXT:
            split = decode_splits(ctx.num_reqs, ctx.first_kv_cache.shape[3], device)
        return TritonPlan(
            ctx.num_tokens,
            self._query_start(ctx),
            ctx.seq_lens_t,
            ctx.block_tables,
            max_query_len,
            split,
        )

    def _static_plan(self, ctx: ForwardContext, q_len: int):
        from tokenbus.model.triton_attention import TritonPlan, decode_splits

        split = decode_splits(ctx.num_reqs, ctx.first_kv_cache.shape[3], ctx.block_tables.device)
        return TritonPlan(
            ctx.num_tokens, self._query_start(ctx), ctx.seq_lens_t, ctx.block_tables, q_len, split
        )

    @staticmethod
    def _query_start(ctx: ForwardContext) -> torch.Tensor:
        if ctx.query_start_loc_t is not None:
            return ctx.query_start_loc_t
        return torch.tensor(ctx.query_start_loc, dtype=torch.int64, device=ctx.block_tables.device)


def triton_problem(device: str | torch.device, block_size: int = 16) -> str | None:
    """Why the Triton backend cannot run on `device` with KV blocks of `block_size`, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "its kernels need a CUDA device (TRITON_INTERPRET=1 runs them on CPU, for tests)"
    if block_size < 16:  # a block's tokens are a tl.dot dimension (triton_attention.py)
        return f"its kernels need --block-size 16 or more, not {block_size}"
    return None


def select_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, row_invariant: bool = False
) -> AttentionBackend:
    """The backend for --attention-backend `name` (see select_attention_kernel);
    `row_invariant` (--batch-invariant) needs the native kernel, whose decode path is the only
    one that sums a query's row the same in any step."""
    if row_invariant and name not in ("auto", "native"):
        raise ValueError(f"batch_invariant needs the native attention kernel, not {name!r}")
    if name == "triton":
        if (problem := triton_problem(device)) is not None:
            raise ValueError(f"attention_backend 'triton': {problem}")
        return TritonAttentionBackend(dtype)
    kernel = select_attention_kernel("native" if row_invariant else name, device, dtype)
    if kernel is None:
        return TorchAttentionBackend(dtype)
    return NativeAttentionBackend(dtype, kernel, row_invariant)
