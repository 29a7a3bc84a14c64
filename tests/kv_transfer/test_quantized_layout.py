"""Quantized K/V in the connectors' layout (--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | q8_0): the
dtype names the layout (its fingerprint keys a store's files), blocks have the pool's real
shape and bytes, and a peer or a stored block of another dtype is refused by name."""

from __future__ import annotations

import types

import pytest
import torch

from tokenbus.config import KVTransferConfig
from tokenbus.kv_transfer.base import ConnectorContext, KVConnectorWorker, KVLayout
from tokenbus.kv_transfer.hash_store import HashStoreWorker
from tokenbus.kv_transfer.p2p_peers import handshake_reply
from tokenbus.kv_transfer.p2p_transport import ERROR, Hello
from tokenbus.model import kv_quant


def _layout(dtype: str) -> KVLayout:
    return KVLayout(
        model="smollm2",
        dtype=dtype,
        quantization="gguf",
        block_size=16,
        num_layers=2,
        num_kv_heads=3,
        head_dim=64,
    )


@pytest.mark.parametrize(
    "dtype, storage, row_width, row_bytes",
    [
        ("float16", "float16", 64, 128),
        ("fp8_e4m3", "float8_e4m3fn", 64, 64),
        ("fp8_e5m2", "float8_e5m2", 64, 64),
        ("q8_0", "uint8", 68, 68),  # two block_q8_0 a row: 2 x (2 + 32) bytes
    ],
)
def test_layout_names_the_pools_tensors(dtype, storage, row_width, row_bytes):
    layout = _layout(dtype)
    assert layout.storage_dtype == storage
    assert layout.block_shape == [2, 2, 16, 3, row_width]
    assert layout.block_nbytes == 2 * 2 * 16 * 3 * row_bytes
    # what the worker allocates for this dtype is exactly that
    stored = kv_quant.kv_storage_dtype(dtype)
    assert str(stored).removeprefix("torch.") == storage
    assert kv_quant.row_width(stored, 64) == row_width
    fingerprints = {_layout(d).fingerprint() for d in ("float16", "fp8_e4m3", "fp8_e5m2", "q8_0")}
    assert len(fingerprints) == 4  # a store keyed by layout never mixes them


def test_a_peer_of_another_kv_dtype_is_refused_by_name():
    ours = _layout("q8_0")
    theirs = _layout("float16").describe()
    reply = handshake_reply(ours, "prefill-1", Hello(seq=1, engine_id="decode-1", layout=theirs))
    assert reply.status == ERROR
    assert "dtype: ours 'q8_0', theirs 'float16'" in reply.message


def test_a_stored_block_of_another_dtype_is_refused():
    ctx = ConnectorContext(KVTransferConfig("SharedStorageConnector"), _layout("q8_0"), "test")
    worker = types.SimpleNamespace(ctx=ctx)
    HashStoreWorker._check_block(worker, torch.zeros(2, 2, 16, 3, 68, dtype=torch.uint8))
    for wrong in (
        torch.zeros(2, 2, 16, 3, 64, dtype=torch.float16),  # a float16 pool's block
        torch.zeros(2, 2, 16, 3, 64, dtype=torch.uint8),  # q8_0 bytes of another head size
    ):
        with pytest.raises(ValueError, match=r"the pool's q8_0 \(uint8\)"):
            HashStoreWorker._check_block(worker, wrong)


@pytest.mark.parametrize("dtype", kv_quant.QUANTIZED_KV_DTYPES)
def test_blocks_copy_out_and_back_into_a_quantized_pool(dtype):
    """read_blocks / write_blocks move a quantized pool's bytes unchanged (fp8 has no
    index_copy_ in torch: they go as bytes)."""
    name = kv_quant.kv_dtype_name(dtype)
    worker = KVConnectorWorker(
        ConnectorContext(KVTransferConfig("SharedStorageConnector"), _layout(name), "test")
    )
    g = torch.Generator().manual_seed(0)
    pools = [
        kv_quant.quantize(torch.randn(2, 6, 16, 3, 64, generator=g) * 4, dtype) for _ in range(2)
    ]
    worker.register_kv_caches(pools)
    blocks = worker.read_blocks([4, 1])
    assert blocks.dtype == dtype and list(blocks.shape) == [2, 2, 2, 16, 3, pools[0].shape[-1]]
    worker.write_blocks([2, 5], blocks)
    for pool in pools:
        as_bytes = pool.view(torch.uint8)
        assert torch.equal(as_bytes[:, 2], as_bytes[:, 4]) and torch.equal(
            as_bytes[:, 5], as_bytes[:, 1]
        )
