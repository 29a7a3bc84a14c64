"""Recurrent layers' state pools, and the row each running request holds in them (L3).

A recurrent layer (model/recurrent.py: a short convolution, Mamba2, Gated DeltaNet) keeps, for
each request, what the next step of that request needs from the tokens before it, in a fixed
size: one row of the layer's pool [num_rows, ...]. The pools sit in the step's per-layer caches
(ForwardContext's kv_caches) where an attention layer has its K/V.

Rows follow the scheduler's running set, which max_num_seqs bounds: a request takes a row when
it is (re)scheduled from its first token — the worker sees it as a new request, first or after a
preemption — and gives it back when it finishes or is preempted (both come with the next step,
before that step's new requests take rows). Its row is zeroed when taken: a state starts empty,
as HF's cache does. A recomputed request rebuilds its state from token 0: prefix caching, whose
hits would skip the tokens a state is made of, is off for these models (engine/setup.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def state_shapes(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Each recurrent layer's state for one request (CausalLM.state_shapes); {}: none."""
    shapes = getattr(model, "state_shapes", None)
    return shapes() if shapes is not None else {}


def state_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[int, torch.dtype]:
    """Each recurrent layer's state dtype: fp32 where its mixer keeps its state so (a
    state-space or delta-rule S, which HF keeps in fp32 too), else the activations' `dtype`."""
    layers = getattr(model, "layers", ())
    return {
        layer: torch.float32 if getattr(layers[layer].mixer, "fp32_state", False) else dtype
        for layer in state_shapes(model)
    }


def state_pool_bytes(model: nn.Module, num_rows: int, dtype: torch.dtype) -> int:
    """The bytes allocate_state_pools takes (kept out of the KV budget)."""
    dtypes = state_dtypes(model, dtype)
    return num_rows * sum(
        torch.Size(shape).numel() * dtypes[layer].itemsize
        for layer, shape in state_shapes(model).items()
    )


def allocate_state_pools(
    model: nn.Module, num_rows: int, dtype: torch.dtype, device: torch.device
) -> dict[int, torch.Tensor]:
    """layer -> its pool [num_rows, *state], zeroed, in its state dtype (state_dtypes)."""
    dtypes = state_dtypes(model, dtype)
    return {
        layer: torch.zeros((num_rows, *shape), dtype=dtypes[layer], device=device)
        for layer, shape in state_shapes(model).items()
    }


class RequestStates:
    """Which row of the pools each running request holds."""

    def __init__(self, pools: Iterable[torch.Tensor]) -> None:
        self.pools = list(pools)
        num_rows = self.pools[0].shape[0]
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out row 0 first
        self._rows: dict[str, int] = {}

    def start(self, req_id: str) -> int:
        """A row for a request computing from its first token, its state zeroed."""
        if req_id in self._rows:
            raise RuntimeError(f"request {req_id!r} already holds state row {self._rows[req_id]}")
        if not self._free:
            raise RuntimeError(
                f"no recurrent-state row is free: all {len(self._rows)} are held "
                "(more requests running than max_num_seqs)"
            )
        row = self._free.pop()
        for pool in self.pools:
            pool[row].zero_()
        self._rows[req_id] = row
        return row

    def release(self, req_id: str) -> None:
        """Its row back (a request holding none: nothing)."""
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    @property
    def held_rows(self) -> dict[str, int]:
        """Request id -> its row, for each request holding one."""
        return dict(self._rows)
