"""HashStore worker half alone (SharedStorageConnector's files): what a step must not store,
and failures that must stay one block's miss instead of the engine's crash."""

from __future__ import annotations

import msgspec
import torch

from tokenbus.config import KVTransferConfig
from tokenbus.core.kv.block_hash import hash_block_tokens
from tokenbus.core.outputs import KVConnectorOutput
from tokenbus.kv_transfer.base import ConnectorContext, KVLayout
from tokenbus.kv_transfer.hash_store import BlockJob, HashStoreMeta, HashStoreNews
from tokenbus.kv_transfer.shared_storage import SharedStorageScheduler, SharedStorageWorker

BLOCK = 16
LAYOUT = KVLayout(
    model="tiny",
    dtype="float32",
    quantization="none",
    block_size=BLOCK,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
)


def _hash(i: int) -> bytes:
    return hash_block_tokens(None, [i] * BLOCK)


def _halves(tmp_path):
    ctx = ConnectorContext(
        KVTransferConfig(
            "SharedStorageConnector",
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        ),
        LAYOUT,
        "test",
    )
    worker = SharedStorageWorker(ctx)
    worker.register_kv_caches([torch.randn(2, 8, BLOCK, 2, 16) for _ in range(2)])
    return SharedStorageScheduler(ctx), worker


def _run_step(worker, meta: HashStoreMeta) -> KVConnectorOutput:
    worker.bind_connector_metadata(msgspec.msgpack.encode(meta))
    worker.start_load_kv()
    worker.wait_for_save()
    return worker.build_output(set())


def test_a_step_whose_load_failed_stores_nothing_it_computed(tmp_path):
    scheduler, worker = _halves(tmp_path)
    missing, computed = _hash(1), _hash(2)
    scheduler._saving.add(computed)  # as _plan_saves left it
    # Block 6 was computed over block 5, whose load fails: its K/V must not enter the store.
    output = _run_step(
        worker, HashStoreMeta(loads={"r": [BlockJob(5, missing)]}, saves=[BlockJob(6, computed)])
    )
    assert output.invalid_block_ids == [5]
    assert not worker.files.exists(computed)
    news = msgspec.msgpack.decode(output.worker_meta, type=HashStoreNews)
    assert computed in news.dropped and computed not in news.stored
    scheduler.update_connector_output(output)
    assert computed not in scheduler._saving  # a later step may save it (computed right) again


def test_a_store_that_fails_drops_that_block_only(tmp_path, monkeypatch):
    scheduler, worker = _halves(tmp_path)
    real_write = worker.files.write

    def write(block_hash, kv):
        if block_hash == _hash(2):
            raise OSError(28, "No space left on device")
        return real_write(block_hash, kv)

    monkeypatch.setattr(worker.files, "write", write)
    scheduler._saving.update({_hash(1), _hash(2)})
    output = _run_step(worker, HashStoreMeta(saves=[BlockJob(1, _hash(1)), BlockJob(2, _hash(2))]))
    news = msgspec.msgpack.decode(output.worker_meta, type=HashStoreNews)
    assert news.stored == [_hash(1)] and news.dropped == [_hash(2)]
    scheduler.update_connector_output(output)
    assert not scheduler._saving


def test_a_stored_block_of_another_shape_is_a_miss(tmp_path):
    _, worker = _halves(tmp_path)
    worker.files.write(_hash(1), torch.randn(2, 2, BLOCK, 2, 8))  # head_dim 8, checksum fine
    before = worker.kv_caches[0].clone()
    output = _run_step(worker, HashStoreMeta(loads={"r": [BlockJob(3, _hash(1))]}))
    assert output.invalid_block_ids == [3]
    assert torch.equal(worker.kv_caches[0], before)
