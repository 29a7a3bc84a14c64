"""The worker half of a KV connector, and what both halves share (L2).

Per step, the model runner calls, in this order:

    bind_connector_metadata(meta) → start_load_kv() → [forward: per layer
    wait_for_layer_load(i) … save_kv_layer(i, kv_cache)] → wait_for_save() → build_output(ids)

`start_load_kv` may finish a synchronous load at once (the blocks are read before any layer
runs) or start an asynchronous one, reported later through `get_finished`. A connector may do
its saving per layer or all of it in `wait_for_save`; after `wait_for_save` returns, the
blocks it saved may be overwritten.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenbus.config import KVTransferConfig
from tokenbus.core.outputs import KVConnectorOutput
from tokenbus.kv_transfer.block_bytes import BlockSpec, PoolBytes

# Re-exported: connectors and their tests name the layout beside the context it rides in.
from tokenbus.kv_transfer.layout import KVLayout as KVLayout


@dataclass(frozen=True)
class ConnectorContext:
    """What every connector is built with (both halves)."""

    config: KVTransferConfig
    layout: KVLayout
    engine_id: str
    data_parallel_rank: int = 0  # which of the data-parallel engines this is

    @property
    def extra(self) -> dict:
        return self.config.kv_connector_extra_config


@dataclass
class TransferCounters:
    """Bytes and seconds moved since the last report."""

    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    invalid_block_ids: set[int] = field(default_factory=set)

    def timed_load(self, num_bytes: int, started: float) -> None:
        self.bytes_loaded += num_bytes
        self.load_seconds += time.perf_counter() - started

    def timed_save(self, num_bytes: int, started: float) -> None:
        self.bytes_saved += num_bytes
        self.save_seconds += time.perf_counter() - started


class KVConnectorWorker:
    """Base of every worker half: no-ops, so a connector overrides only what it uses."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.kv_caches: list[torch.Tensor] = []
        self.block_spec: BlockSpec | None = None  # one block as the pool holds it
        self.pool_bytes: PoolBytes | None = None  # a CPU pool's bytes: loads land there directly
        self.counters = TransferCounters()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The pool, per layer [2, num_blocks, block_size, num_kv_heads, row] (row: head_dim
        values in the layout's dtype, model/kv_quant.py)."""
        self.kv_caches = kv_caches
        self.block_spec = BlockSpec.of_pool(kv_caches)
        self.pool_bytes = PoolBytes.of(kv_caches, self.ctx.layout)

    def bind_connector_metadata(self, metadata: bytes | None) -> None:
        """This step's metadata from the scheduler half (None: nothing to do)."""

    def start_load_kv(self) -> None:
        """Load (or start loading) what the metadata names."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Return once layer `layer`'s loads for this step are in the pool."""

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Layer `layer` of this step is computed (its K/V written into `kv_cache`)."""

    def wait_for_save(self) -> None:
        """Return once every save of this step no longer needs the pool's blocks."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests done sending, requests done receiving) since the last call.
        `finished_req_ids`: requests the scheduler finished since the last step."""
        return set(), set()

    def worker_meta(self) -> bytes | None:
        """Connector-specific news for the scheduler half (taken once)."""
        return None

    def build_output(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        sending, recving = self.get_finished(finished_req_ids)
        counters, self.counters = self.counters, TransferCounters()
        output = KVConnectorOutput(
            finished_sending=sorted(sending),
            finished_recving=sorted(recving),
            invalid_block_ids=sorted(counters.invalid_block_ids),
            bytes_loaded=counters.bytes_loaded,
            bytes_saved=counters.bytes_saved,
            load_seconds=counters.load_seconds,
            save_seconds=counters.save_seconds,
            worker_meta=self.worker_meta(),
        )
        return None if output.is_empty else output

    def shutdown(self) -> None:
        """Stop background threads and sockets."""

    # ------------------------------------------------------------------ block copies
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """K/V of blocks from every layer: [num_layers, 2, len(block_ids), block_size, Hkv, D]
        (a copy, on the pool's device)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        return torch.stack([cache.index_select(1, index) for cache in self.kv_caches])

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """The inverse of read_blocks: kv [num_layers, 2, n, block_size, Hkv, D] into the pool."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        kv = kv.to(self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            if cache.element_size() == 1:  # fp8 and q8_0 as bytes: no index_copy_ for fp8
                cache, kv = cache.view(torch.uint8), kv.view(torch.uint8)
            cache.index_copy_(1, index, kv[layer])
