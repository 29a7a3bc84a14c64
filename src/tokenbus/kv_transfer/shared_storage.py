"""SharedStorageConnector (L2): every full block's K/V in a safetensors file under a directory,
keyed by block hash. For debugging and tests; two instances sharing the directory are a
disaggregated pair (the producer's saves are the consumer's loads).

    --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'

Unbounded: nothing is ever evicted (the OffloadingConnector bounds its tiers).
"""

from __future__ import annotations

import torch

from tokenbus.kv_transfer.base import ConnectorContext
from tokenbus.kv_transfer.block_files import BlockFiles
from tokenbus.kv_transfer.hash_store import HashStoreScheduler, HashStoreWorker


def _files(ctx: ConnectorContext) -> BlockFiles:
    path = ctx.extra.get("shared_storage_path")
    if not isinstance(path, str) or not path:
        raise ValueError(
            "SharedStorageConnector needs kv_connector_extra_config.shared_storage_path "
            "(a directory)"
        )
    return BlockFiles(path, ctx.layout.fingerprint())


class SharedStorageScheduler(HashStoreScheduler):
    def __init__(self, ctx: ConnectorContext) -> None:
        self.files = _files(ctx)
        super().__init__(ctx, self.files.exists)


class SharedStorageWorker(HashStoreWorker):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.files = _files(ctx)

    def load_into(self, block_hash: bytes, chunks: list[memoryview]) -> None:
        self.files.read_into(block_hash, chunks, self.block_spec)

    def store(self, block_hash: bytes, kv: torch.Tensor) -> None:
        self.files.write(block_hash, kv)
