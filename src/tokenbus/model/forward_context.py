"""The explicit per-step attention input (L2). Built by the worker, read by attention layers.

Batch layout: requests are ordered so that the `num_decodes` requests with exactly one query
token come first; the rest (prefill chunks, spec-decode verification) follow. Token i of the
flattened batch belongs to request r where query_start_loc[r] <= i < query_start_loc[r + 1].

`attn_metadata` is what the attention layers read (model/attention.py: an AttentionPlan, or a
static decode plan for a captured step). The worker builds it through the model's attention
backend (model/attention_backend.py) before the forward; the model never builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVGroupInputs:
    """A hybrid KV cache's group past the first (core/kv/hybrid.py): its own slots and block
    tables over the same K/V buffers, and the attention plan built from them."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64
    attn_metadata: Any = None


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [num_tokens] int64: position of each token in its sequence
    # [num_tokens] int64: block_id * block_size + offset, K/V write target
    slot_mapping: torch.Tensor
    # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; a recurrent layer's: its
    # state pool (see recurrent_layers)
    kv_caches: list[torch.Tensor]
    block_size: int
    query_start_loc: list[int]  # [num_reqs + 1], host ints
    seq_lens: list[
        int
    ]  # [num_reqs] tokens in the cache after this step (context + query), host ints
    seq_lens_t: torch.Tensor  # [num_reqs] int64, the same on the device
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with 0 (the null block)
    num_decodes: int  # the first num_decodes requests have query length 1
    # Built by the worker before the forward (AttentionBackend.build_metadata & co).
    attn_metadata: Any = None
    # query_start_loc on the device (int64 [num_reqs + 1]); None: made from the host list when
    # needed.
    query_start_loc_t: torch.Tensor | None = None
    # A KV connector's worker half (kv_transfer/base.KVConnectorWorker), told of each layer:
    # wait_for_layer_load(i) before layer i runs, save_kv_layer(i, cache) after.
    kv_connector: Any = None
    # A hybrid KV cache: groups 1.. (slot_mapping, block_tables and attn_metadata above are
    # group 0's) and each layer's group (-1: a layer holding no K/V); empty: every layer in
    # group 0.
    kv_groups: list[KVGroupInputs] = field(default_factory=list)
    layer_groups: tuple[int, ...] = ()
    # Recurrent layers (short convolutions, Mamba2, Gated DeltaNet: model/recurrent.py) hold a
    # state per request, not K/V: their kv_caches entry is their state pool, state_rows
    # [num_reqs] int64 each request's row of it, recurrent_plan what they read this step (the
    # model builds it).
    recurrent_layers: frozenset[int] = frozenset()
    state_rows: torch.Tensor | None = None
    recurrent_plan: Any = None

    def layer_inputs(self, layer: int) -> tuple[torch.Tensor, Any]:
        """(slot_mapping, attn_metadata) of decoder layer `layer`'s KV group; a recurrent
        layer's (its requests' state rows, the step's recurrent plan)."""
        if layer in self.recurrent_layers:
            return self.recurrent_plan.rows, self.recurrent_plan
        group = self.layer_groups[layer] if self.layer_groups else 0
        if group == 0:
            return self.slot_mapping, self.attn_metadata
        inputs = self.kv_groups[group - 1]
        return inputs.slot_mapping, inputs.attn_metadata

    def plan_attention(self, build: Callable[[ForwardContext], Any]) -> None:
        """Set this step's attention plans: `build` (an attention backend's entry point) of
        group 0's view into attn_metadata, and of each further KV group's view into its
        inputs."""
        self.attn_metadata = build(self.group_context(0) if self.layer_groups else self)
        for group, inputs in enumerate(self.kv_groups, start=1):
            inputs.attn_metadata = build(self.group_context(group))

    def group_context(self, group: int) -> ForwardContext:
        """This step as KV group `group` sees it: its slots and tables, and its layers' pools
        alone (the others' entries empty), so its plan fits its layers' K/V shape (Gemma 4's
        local and global layers differ)."""
        slot_mapping, block_tables = self.slot_mapping, self.block_tables
        if group > 0:
            inputs = self.kv_groups[group - 1]
            slot_mapping, block_tables = inputs.slot_mapping, inputs.block_tables
        empty = self.kv_caches[0].new_empty(0)
        kv_caches = [
            cache if i in self.recurrent_layers or self.layer_groups[i] == group else empty
            for i, cache in enumerate(self.kv_caches)
        ]
        return dataclasses.replace(
            self,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            kv_caches=kv_caches,
            attn_metadata=None,
            kv_groups=[],
            layer_groups=(),
        )

    @property
    def attention_kv_caches(self) -> list[torch.Tensor]:
        """The attention layers' K/V pools [2, blocks, block_size, Hkv, row] (a recurrent
        layer's entry is its state pool, an MLP-only layer's empty: both left out)."""
        return [
            cache
            for i, cache in enumerate(self.kv_caches)
            if i not in self.recurrent_layers and cache.dim() == 5
        ]

    @property
    def first_kv_cache(self) -> torch.Tensor:
        """The first attention layer's K/V pool: every layer's has its block size, dtype and
        device (the plans read the pool's layout from it), and its KV heads and head size but
        where a model's layers differ in them (ModelArch.layer_kv_shapes)."""
        return self.attention_kv_caches[0]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]
