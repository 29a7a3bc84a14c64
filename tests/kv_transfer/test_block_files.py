"""Block files and the pool's bytes: a file is plain safetensors, a load lands in the pool's own
memory (or a staging tensor) exactly where index_copy_ would put it, and every kind of bad file
is a miss that is removed, with the destination untouched whenever the header gives it away."""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenbus.config import KVTransferConfig
from tokenbus.core.kv.block_hash import hash_block_tokens
from tokenbus.kv_transfer.base import ConnectorContext, KVLayout
from tokenbus.kv_transfer.block_bytes import BlockSpec, PoolBytes, StagedBlocks, tensor_bytes
from tokenbus.kv_transfer.block_files import FORMAT, BlockFiles, CorruptBlockFile
from tokenbus.kv_transfer.hash_store import BlockJob, HashStoreMeta
from tokenbus.kv_transfer.shared_storage import SharedStorageWorker
from tokenbus.model import kv_quant

BLOCK, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 16
LAYOUT = KVLayout(
    model="tiny",
    dtype="bfloat16",
    quantization="none",
    block_size=BLOCK,
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
)
SPEC = BlockSpec(torch.bfloat16, (LAYERS, 2, BLOCK, HEADS, HEAD_DIM))
NUM_POOL_BLOCKS = 8


def _hash(i: int) -> bytes:
    return hash_block_tokens(None, [i] * BLOCK)


def _kv(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.shape, generator=generator).to(torch.bfloat16)


def _pool() -> list[torch.Tensor]:
    shape = (2, NUM_POOL_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]


def test_a_block_file_is_safetensors_and_reads_into_the_pool(tmp_path):
    files = BlockFiles(tmp_path, LAYOUT.fingerprint())
    kv = _kv(0)
    size = files.write(_hash(0), kv)
    path = files.path(_hash(0))
    # Every block of a layout has a header of one length: a load reads it in one pread.
    assert size == path.stat().st_size == files.write(_hash(1), _kv(1))
    assert torch.equal(load_file(path)["kv"], kv)  # any safetensors reader reads it
    with safe_open(path, "pt") as f:
        assert f.metadata()["format"] == FORMAT and f.metadata()["block_hash"] == _hash(0).hex()

    pool = _pool()
    pool_bytes = PoolBytes.of(pool, LAYOUT)
    assert pool_bytes is not None
    files.read_into(_hash(0), pool_bytes.block_chunks(5), SPEC)
    for layer in range(LAYERS):
        expected = torch.zeros_like(pool[layer])
        expected.index_copy_(1, torch.tensor([5]), kv[layer].unsqueeze(1))
        assert torch.equal(pool[layer], expected)  # block 5 of K and V, nothing else
    assert torch.equal(files.read(_hash(0), SPEC), kv)


def test_staged_blocks_are_write_blocks_input(tmp_path):
    staged = StagedBlocks(SPEC, 3)
    blocks = [_kv(i) for i in range(3)]
    for i, kv in enumerate(blocks):
        chunk_bytes = [bytes(c) for c in _chunks_of(kv)]
        for chunk, data in zip(staged.block_chunks(i), chunk_bytes):
            chunk[:] = data
    assert torch.equal(staged.tensor, torch.stack(blocks, dim=2))  # [L, 2, n, bs, Hkv, D]


def _chunks_of(kv: torch.Tensor) -> list[memoryview]:
    flat = tensor_bytes(kv)
    size = len(flat) // (LAYERS * 2)
    return [flat[i * size : (i + 1) * size] for i in range(LAYERS * 2)]


def test_pool_bytes_only_for_contiguous_cpu_pools_of_the_layout():
    assert PoolBytes.of(_pool(), LAYOUT) is not None
    strided = [
        torch.zeros(NUM_POOL_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16).transpose(
            0, 1
        )
        for _ in range(LAYERS)
    ]
    assert PoolBytes.of(strided, LAYOUT) is None
    other_dtype = [cache.float() for cache in _pool()]  # blocks twice the layout's size
    assert PoolBytes.of(other_dtype, LAYOUT) is None
    assert PoolBytes.of(_pool()[:1], LAYOUT) is None


def _v1_file(files: BlockFiles, block_hash: bytes) -> None:
    """A block as the previous format wrote it (a CRC-32, safetensors' own header)."""
    meta = {"format": "tokenbus-kv-block-1", "block_hash": block_hash.hex(), "crc32": "1"}
    save_file({"kv": _kv(0)}, files.path(block_hash), metadata=meta)


def _other_block(files: BlockFiles, block_hash: bytes) -> None:
    files.write(_hash(99), _kv(0))
    files.path(_hash(99)).rename(files.path(block_hash))


def _other_shape(files: BlockFiles, block_hash: bytes) -> None:
    files.write(block_hash, torch.zeros(LAYERS, 2, BLOCK, HEADS, 8, dtype=torch.bfloat16))


def _edit_bytes(edit):
    def make(files: BlockFiles, block_hash: bytes) -> None:
        files.write(block_hash, _kv(0))
        path = files.path(block_hash)
        path.write_bytes(edit(path.read_bytes()))

    return make


@pytest.mark.parametrize(
    "make_file, message, header_bad",
    [
        (_v1_file, "format 'tokenbus-kv-block-1', expected 'tokenbus-kv-block-2'", True),
        (_other_block, "it holds another block", True),
        (_other_shape, "it holds BF16 [2, 2, 16, 2, 8], the pool's blocks are BF16", True),
        (_edit_bytes(lambda data: data[:5]), "truncated header", True),
        (_edit_bytes(lambda data: b"\xff" * 8 + data[8:]), "unreadable", True),
        (_edit_bytes(lambda data: data[:-100]), f"truncated: {SPEC.nbytes - 100} of", False),
        (_edit_bytes(lambda data: data + b"\0"), "longer than its header says", False),
        (
            _edit_bytes(lambda data: data[:-1] + bytes([data[-1] ^ 1])),
            "checksum mismatch",
            False,
        ),
    ],
)
def test_a_bad_file_is_a_miss_and_removed(tmp_path, caplog, make_file, message, header_bad):
    files = BlockFiles(tmp_path, LAYOUT.fingerprint())
    files.path(_hash(1)).parent.mkdir(exist_ok=True)
    make_file(files, _hash(1))
    pool = _pool()
    with caplog.at_level(logging.WARNING, logger="tokenbus.kv_transfer.block_files"):
        with pytest.raises(CorruptBlockFile):
            files.read_into(_hash(1), PoolBytes.of(pool, LAYOUT).block_chunks(3), SPEC)
    assert message in caplog.text
    assert not files.path(_hash(1)).exists()
    if header_bad:  # caught before a byte reached the pool
        assert all(not cache.any() for cache in pool)
    with pytest.raises(FileNotFoundError):  # removed: the next load is a plain miss
        files.read_into(_hash(1), PoolBytes.of(pool, LAYOUT).block_chunks(3), SPEC)


def _worker(tmp_path, pool: list[torch.Tensor]) -> SharedStorageWorker:
    ctx = ConnectorContext(
        KVTransferConfig(
            "SharedStorageConnector",
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        ),
        LAYOUT,
        "test",
    )
    worker = SharedStorageWorker(ctx)
    worker.register_kv_caches(pool)
    return worker


@pytest.mark.parametrize("direct", [True, False])
def test_worker_loads_into_the_pool_directly_or_staged(tmp_path, direct):
    blocks = [_kv(i) for i in range(3)]
    files = BlockFiles(tmp_path, LAYOUT.fingerprint())
    for i, kv in enumerate(blocks):
        files.write(_hash(i), kv)
    pool = _pool()
    worker = _worker(tmp_path, pool)
    assert worker.pool_bytes is not None
    if not direct:
        worker.pool_bytes = None  # as for a GPU pool: a host tensor, then write_blocks
    jobs = [BlockJob(6, _hash(0)), BlockJob(2, _hash(1)), BlockJob(3, _hash(2))]
    worker.bind_connector_metadata(msgspec.msgpack.encode(HashStoreMeta(loads={"r": jobs})))
    worker.start_load_kv()
    output = worker.build_output(set())
    assert output.invalid_block_ids == [] and output.bytes_loaded == 3 * SPEC.nbytes
    expected = _pool()
    index = torch.tensor([6, 2, 3])
    for layer in range(LAYERS):
        expected[layer].index_copy_(1, index, torch.stack(blocks, dim=2)[layer])
        assert torch.equal(pool[layer], expected[layer])


@pytest.mark.parametrize("dtype", kv_quant.QUANTIZED_KV_DTYPES)
def test_a_quantized_pools_blocks_go_to_disk_and_back_as_they_are(tmp_path, dtype):
    layout = KVLayout(
        model="tiny",
        dtype=kv_quant.kv_dtype_name(dtype),
        quantization="none",
        block_size=BLOCK,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=64,
    )
    ctx = ConnectorContext(
        KVTransferConfig(
            "SharedStorageConnector",
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        ),
        layout,
        "test",
    )
    worker = SharedStorageWorker(ctx)
    g = torch.Generator().manual_seed(0)
    pool = [
        kv_quant.quantize(torch.randn(2, 6, BLOCK, HEADS, 64, generator=g) * 4, dtype)
        for _ in range(LAYERS)
    ]
    worker.register_kv_caches(pool)
    assert worker.pool_bytes is not None
    saves = [BlockJob(1, _hash(1)), BlockJob(2, _hash(2))]
    worker.bind_connector_metadata(msgspec.msgpack.encode(HashStoreMeta(saves=saves)))
    worker.wait_for_save()
    loads = [BlockJob(4, _hash(1)), BlockJob(5, _hash(2))]
    worker.bind_connector_metadata(msgspec.msgpack.encode(HashStoreMeta(loads={"r": loads})))
    worker.start_load_kv()
    assert worker.build_output(set()).bytes_loaded == 2 * layout.block_nbytes
    for cache in pool:
        as_bytes = cache.view(torch.uint8)
        assert torch.equal(as_bytes[:, 4:6], as_bytes[:, 1:3])


def test_prefault_maps_pool_pages_without_writing_them():
    pool = _pool()
    for layer, cache in enumerate(pool):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(layer)))
    before = [cache.clone() for cache in pool]
    pool_bytes = PoolBytes.of(pool, LAYOUT)
    assert pool_bytes.prefault(1, 3) and pool_bytes.prefault(6, 99)  # past the end: clipped
    assert all(torch.equal(a, b) for a, b in zip(pool, before))
