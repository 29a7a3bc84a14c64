"""OffloadingConnector: a CPU tier and a disk tier behind a small pool, a persistent prefix cache
across restarts, corrupt files as misses, byte bounds with LRU order, cache_salt isolation."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import re
import threading
import time

import msgspec
import pytest
import torch

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tokenbus import SamplingParams
from tokenbus.config import KVTransferConfig
from tokenbus.core.kv.block_hash import hash_block_tokens
from tokenbus.core.outputs import KVConnectorOutput
from tokenbus.kv_transfer import offloading
from tokenbus.kv_transfer.base import ConnectorContext, KVLayout
from tokenbus.kv_transfer.block_bytes import BlockSpec, PoolBytes, tensor_bytes
from tokenbus.kv_transfer.block_files import BlockFiles
from tokenbus.kv_transfer.hash_store import BlockJob, HashStoreMeta
from tokenbus.kv_transfer.offloading import (
    OffloadConfig,
    OffloadingScheduler,
    OffloadingWorker,
    OffloadNews,
    TieredStore,
)

BLOCK = 16
MAX_TOKENS = 8
# A pool of 24 blocks cannot hold two 200-token prefixes (13 blocks each) at once.
SMALL_POOL = dict(num_kv_blocks=24, max_model_len=320)


def _kv_config(role: str = "kv_both", **extra) -> str:
    return json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": role, "kv_connector_extra_config": extra}
    )


def _llm(model_dir, **engine_args):
    return make_llm(model_dir, enforce_eager=True, **engine_args)  # no step compile: quick starts


def _core(llm):
    return llm.engine.client.engine_core


def _scheduler_half(llm) -> OffloadingScheduler:
    return _core(llm).scheduler.connector


def _worker_half(llm) -> OffloadingWorker:
    return _core(llm).executor.worker.kv_connector


def _sync_news(llm) -> None:
    """Deliver what the worker half learnt after the last step (finished disk writes)."""
    _worker_half(llm).store_tiers.drain()
    meta = _worker_half(llm).worker_meta()
    if meta is not None:
        _scheduler_half(llm).update_connector_output(KVConnectorOutput(worker_meta=meta))


def _block_hashes(prompt: list[int]) -> list[bytes]:
    hashes, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = hash_block_tokens(parent, prompt[i * BLOCK : (i + 1) * BLOCK])
        hashes.append(parent)
    return hashes


_ids = itertools.count()


def _generate(llm, prompts: list[list[int]], cache_salt: str | None = None):
    """Greedy RequestOutputs; unlike LLM.generate it can set a cache_salt (as the server does)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    ids = [f"t{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        llm.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
    finished = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


@pytest.fixture(scope="module")
def family_prompts():
    """Two families of prompts, each a 200-token prefix and a 30–60 token suffix, alternating."""
    prefixes = random_prompts(2, 200, 200, seed=31)
    suffixes = random_prompts(8, 30, 60, seed=32)
    return [prefixes[i % 2] + suffixes[i] for i in range(8)]


@pytest.fixture(scope="module")
def family_expected(tiny_llama_dir, family_prompts):
    hf = load_hf(str(tiny_llama_dir))
    return [hf_greedy(hf, p, MAX_TOKENS) for p in family_prompts]


# ---------------------------------------------------------------------- end to end
def test_small_pool_reloads_evicted_prefixes_from_cpu_tier(
    tiny_llama_dir, family_prompts, family_expected
):
    off = _llm(tiny_llama_dir, **SMALL_POOL)
    assert generate_greedy(off, family_prompts, MAX_TOKENS) == family_expected
    off.shutdown()

    llm = _llm(tiny_llama_dir, **SMALL_POOL, kv_transfer_config=_kv_config(cpu_bytes="64MiB"))
    assert generate_greedy(llm, family_prompts, MAX_TOKENS) == family_expected
    totals = llm.engine.stats_totals
    # Each family's prefix was evicted from the pool by the other's and came back from RAM.
    assert totals["external_prefix_cache_hits"] >= 12 * BLOCK
    assert totals["kv_bytes_loaded"] > 0 and totals["kv_bytes_saved"] > 0
    assert set(llm.engine.last_stats.kv_tier_bytes) == {"cpu"}  # no disk tier configured
    assert_engine_clean(llm)
    llm.shutdown()


def test_tiers_stay_within_their_bounds(tiny_llama_dir, tmp_path, family_prompts, family_expected):
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny llama: 2 layers, 2 KV heads, head_dim 16, fp32
    # RAM for 6 blocks; disk for 28 files: not both families' blocks (2 × 15), one's and more.
    cpu_bytes, disk_bytes = 6 * block_bytes, 28 * (block_bytes + 512)
    llm = _llm(
        tiny_llama_dir,
        **SMALL_POOL,
        kv_transfer_config=_kv_config(
            cpu_bytes=cpu_bytes, disk_path=str(tmp_path), disk_bytes=disk_bytes
        ),
    )
    for prompt, expected in zip(family_prompts, family_expected):
        assert generate_greedy(llm, [prompt], MAX_TOKENS) == [expected]
        tiers = llm.engine.last_stats.kv_tier_bytes
        assert 0 < tiers["cpu"] <= cpu_bytes and tiers["disk"] <= disk_bytes
        _worker_half(llm).store_tiers.drain()
        assert sum(f.stat().st_size for f in tmp_path.rglob("*.safetensors")) <= disk_bytes
    assert llm.engine.stats_totals["external_prefix_cache_hits"] > 0
    # The scheduler's index is exactly what the two tiers hold.
    _sync_news(llm)
    tiers = _worker_half(llm).store_tiers
    assert _scheduler_half(llm)._index == set(tiers.cpu.keys()) | set(tiers.disk.keys())
    assert 0 < tiers.disk.num_bytes <= disk_bytes
    assert _scheduler_half(llm).tier_occupancy() == {
        "cpu": len(tiers.cpu) * block_bytes,
        "disk": tiers.disk.num_bytes,
    }
    assert_engine_clean(llm)
    llm.shutdown()


def test_disk_tier_is_warm_after_a_restart(tiny_llama_dir, tmp_path, monkeypatch):
    prompt = random_prompts(1, 300, 300, seed=41)[0]
    expected = hf_greedy(load_hf(str(tiny_llama_dir)), prompt, MAX_TOKENS)
    write = BlockFiles.write

    def slow_write(self, block_hash, kv):  # the queue is still full when the engine shuts down
        time.sleep(0.02)
        return write(self, block_hash, kv)

    monkeypatch.setattr(BlockFiles, "write", slow_write)
    first = _llm(tiny_llama_dir, kv_transfer_config=_kv_config(disk_path=str(tmp_path)))
    assert generate_greedy(first, [prompt], MAX_TOKENS) == [expected]
    first.shutdown()  # flushes the write queue
    monkeypatch.undo()
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == (len(prompt) + MAX_TOKENS - 1) // BLOCK  # every full block, outputs too

    second = _llm(tiny_llama_dir, kv_transfer_config=_kv_config(disk_path=str(tmp_path)))
    assert _scheduler_half(second).tier_occupancy()["disk"] == sum(f.stat().st_size for f in files)
    [out] = _generate(second, [prompt])
    assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert second.engine.stats_totals["prefix_cache_hits"] == 0  # a fresh pool: all from disk
    assert_engine_clean(second)
    second.shutdown()


def test_corrupt_and_truncated_files_are_misses(tiny_llama_dir, tmp_path, caplog):
    prompts = random_prompts(2, 100, 120, seed=51)
    hf = load_hf(str(tiny_llama_dir))
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    writer = _llm(tiny_llama_dir, kv_transfer_config=_kv_config(disk_path=str(tmp_path)))
    assert generate_greedy(writer, prompts, MAX_TOKENS) == expected
    files = _worker_half(writer).store_tiers.files
    writer.shutdown()

    flipped, truncated = _block_hashes(prompts[0])[2], _block_hashes(prompts[1])[3]
    data = bytearray(files.path(flipped).read_bytes())
    data[-40:-32] = bytes(b ^ 0xFF for b in data[-40:-32])  # inside the tensor: a CRC mismatch
    files.path(flipped).write_bytes(bytes(data))
    path = files.path(truncated)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    # A consumer only: it saves nothing, so the removed files stay removed.
    reader = _llm(
        tiny_llama_dir, kv_transfer_config=_kv_config("kv_consumer", disk_path=str(tmp_path))
    )
    assert _scheduler_half(reader).contains(flipped) and _scheduler_half(reader).contains(truncated)
    with caplog.at_level(logging.WARNING, logger="tokenbus.kv_transfer.block_files"):
        outs = _generate(reader, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "checksum mismatch" in caplog.text and "truncated" in caplog.text
    assert not files.path(flipped).exists() and not files.path(truncated).exists()
    assert not _scheduler_half(reader).contains(flipped) and not _scheduler_half(reader).contains(
        truncated
    )
    # The blocks before the bad ones did load: two of the first prompt, three of the second.
    assert reader.engine.stats_totals["kv_bytes_loaded"] == (2 + 3) * BLOCK_BYTES
    assert_engine_clean(reader)
    reader.shutdown()


def test_block_gone_from_the_tier_is_recomputed(tiny_llama_dir, family_prompts, family_expected):
    """The index claims a block the worker no longer has: the load fails, the request recomputes."""
    llm = _llm(tiny_llama_dir, kv_transfer_config=_kv_config(cpu_bytes="64MiB"))
    prompt = family_prompts[0]
    assert generate_greedy(llm, [prompt], MAX_TOKENS) == [family_expected[0]]
    lost = _block_hashes(prompt)[4]
    _worker_half(llm).store_tiers.cpu.pop(lost)  # behind the scheduler half's back
    assert llm.reset_prefix_cache()
    loaded_before = llm.engine.stats_totals["kv_bytes_loaded"]
    assert generate_greedy(llm, [prompt], MAX_TOKENS) == [family_expected[0]]
    assert (
        llm.engine.stats_totals["kv_bytes_loaded"] - loaded_before == 4 * BLOCK_BYTES
    )  # blocks 0–3
    # Reported dropped, then saved again by the recompute.
    assert _scheduler_half(llm).contains(lost) and lost in _worker_half(llm).store_tiers.cpu
    assert_engine_clean(llm)
    llm.shutdown()


def test_cache_salt_never_hits_another_salts_blocks(tiny_llama_dir, family_prompts):
    llm = _llm(tiny_llama_dir, kv_transfer_config=_kv_config(cpu_bytes="64MiB"))
    prompt = family_prompts[1]
    [alice] = _generate(llm, [prompt], cache_salt="alice")
    for salt in ("bob", None, "alice"):
        assert llm.reset_prefix_cache()  # only the connector's tier can hit now
        hits_before = llm.engine.stats_totals["external_prefix_cache_hits"]
        [out] = _generate(llm, [prompt], cache_salt=salt)
        assert out.outputs[0].token_ids == alice.outputs[0].token_ids
        hits = llm.engine.stats_totals["external_prefix_cache_hits"] - hits_before
        want = (len(prompt) - 1) // BLOCK * BLOCK if salt == "alice" else 0
        assert out.num_cached_tokens == want and hits == want, salt
    assert_engine_clean(llm)
    llm.shutdown()


def test_bad_size_fails_engine_start(tiny_llama_dir):
    with pytest.raises(ValueError, match="cpu_bytes"):
        _llm(tiny_llama_dir, kv_transfer_config=_kv_config(cpu_bytes="-1GiB"))


# ---------------------------------------------------------------------- the tiers alone
LAYOUT = KVLayout(
    model="tiny",
    dtype="float32",
    quantization="none",
    block_size=BLOCK,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
)
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, BLOCK, 2, 16, generator=torch.Generator().manual_seed(seed))


def _hash(i: int) -> bytes:
    return hash_block_tokens(None, [i] * BLOCK)


def _store(**extra) -> TieredStore:
    return TieredStore(OffloadConfig.from_extra(extra), LAYOUT.fingerprint())


SPEC = BlockSpec(torch.float32, (2, 2, BLOCK, 2, 16))


def _load(store: TieredStore, block_hash: bytes) -> torch.Tensor:
    kv = torch.empty(SPEC.shape, dtype=SPEC.dtype)
    store.load_into(block_hash, [tensor_bytes(kv)], SPEC)
    return kv


def test_lru_bounds_and_eviction_news(tmp_path, monkeypatch):
    monkeypatch.setattr(offloading, "MTIME_REFRESH_S", 0.0)  # every use moves the file's mtime
    file_bytes = len(_safetensors_size_probe(tmp_path))
    # five files (their headers may differ by a few bytes), not six
    disk_bytes = 5 * file_bytes + 64
    root = tmp_path / "kv"
    store = _store(cpu_bytes=3 * BLOCK_BYTES, disk_path=str(root), disk_bytes=disk_bytes)
    for i in range(5):
        store.store(_hash(i), _kv(i))
    assert store.drain()
    time.sleep(0.02)  # file times are coarse: order the phases
    assert store.take_news() == ([], 3, _disk_usage(root))  # 0 and 1 left RAM but are on disk
    assert torch.equal(_load(store, _hash(0)), _kv(0))  # from disk: now the newest file
    assert store.drain()
    time.sleep(0.02)
    for i in range(5, 8):
        store.store(_hash(i), _kv(i))
    assert store.drain()
    evicted, num_cpu_blocks, used = store.take_news()
    assert set(evicted) == {_hash(1), _hash(2), _hash(3)}  # left both tiers; 0 was used after 4
    assert num_cpu_blocks == 3 and used == _disk_usage(root) <= disk_bytes
    assert store.cpu.num_bytes <= 3 * BLOCK_BYTES and store.cpu.keys() == [
        _hash(5),
        _hash(6),
        _hash(7),
    ]
    assert _on_disk(root) == {_hash(i) for i in (0, 4, 5, 6, 7)}
    for i in (1, 2, 3):
        with pytest.raises(KeyError):
            _load(store, _hash(i))
    store.close()

    # A restart reads the disk tier in use order (mtime): 0 was read after 4 was written.
    again = _store(cpu_bytes=0, disk_path=str(root), disk_bytes=disk_bytes)
    assert again.disk.keys()[:2] == [_hash(4), _hash(0)]
    assert torch.equal(_load(again, _hash(6)), _kv(6))
    again.close()
    smaller = _store(
        cpu_bytes=0, disk_path=str(root), disk_bytes=2 * file_bytes + 64
    )  # the bound shrank
    assert len(smaller.disk) == 2 and _on_disk(root) == set(smaller.disk.keys())
    assert not {_hash(4), _hash(0)} & _on_disk(root)
    smaller.close()


def _disk_usage(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def _on_disk(root) -> set[bytes]:
    return {bytes.fromhex(p.name.removesuffix(".safetensors")) for p in root.rglob("*.safetensors")}


def _safetensors_size_probe(tmp_path) -> bytes:
    files = BlockFiles(tmp_path / "probe", "x")
    files.write(_hash(0), _kv(0))
    return files.path(_hash(0)).read_bytes()


def test_cpu_only_tier_reports_evictions(tmp_path):
    store = _store(cpu_bytes=2 * BLOCK_BYTES)
    for i in range(4):
        store.store(_hash(i), _kv(i))
    assert store.take_news() == ([_hash(0), _hash(1)], 2, 0)
    _load(store, _hash(2))  # now the newest
    store.store(_hash(4), _kv(4))
    assert store.take_news()[0] == [_hash(3)]
    store.close()


def test_worker_reports_corrupt_file_as_dropped_and_invalid(tmp_path):
    ctx = ConnectorContext(
        KVTransferConfig(
            "OffloadingConnector",
            kv_connector_extra_config={"cpu_bytes": 0, "disk_path": str(tmp_path)},
        ),
        LAYOUT,
        "test",
    )
    worker = OffloadingWorker(ctx)
    worker.register_kv_caches([torch.randn(2, 8, BLOCK, 2, 16) for _ in range(2)])
    hashes = [_hash(i) for i in range(3)]
    worker.bind_connector_metadata(
        msgspec.msgpack.encode(
            HashStoreMeta(saves=[BlockJob(i + 1, h) for i, h in enumerate(hashes)])
        )
    )
    worker.wait_for_save()
    worker.store_tiers.drain()
    news = msgspec.msgpack.decode(worker.build_output(set()).worker_meta, type=OffloadNews)
    assert (
        news.stored == hashes[::-1] and news.num_cpu_blocks == 0
    )  # tail first and news.disk_bytes > 0

    path = worker.store_tiers.files.path(hashes[1])
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    worker.bind_connector_metadata(
        msgspec.msgpack.encode(
            HashStoreMeta(
                loads={
                    "r": [BlockJob(5, hashes[0]), BlockJob(6, hashes[1]), BlockJob(7, hashes[2])]
                }
            )
        )
    )
    worker.start_load_kv()
    output = worker.build_output(set())
    assert output.invalid_block_ids == [6, 7]  # the bad one and every one chained after it
    assert torch.equal(worker.kv_caches[0][:, 5], worker.kv_caches[0][:, 1])  # block 0 did load
    news = msgspec.msgpack.decode(output.worker_meta, type=OffloadNews)
    assert news.dropped == [hashes[1]] and not path.exists()

    scheduler = OffloadingScheduler(ctx)  # a restart: the index from the scan
    assert scheduler.contains(hashes[0]) and not scheduler.contains(hashes[1])
    worker.shutdown()


def test_worker_loads_from_ram_and_disk_and_logs_the_throughput(tmp_path, monkeypatch, caplog):
    ctx = ConnectorContext(
        KVTransferConfig(
            "OffloadingConnector",
            kv_connector_extra_config={"cpu_bytes": 2 * BLOCK_BYTES, "disk_path": str(tmp_path)},
        ),
        LAYOUT,
        "test",
    )
    worker = OffloadingWorker(ctx)
    worker.register_kv_caches([torch.randn(2, 8, BLOCK, 2, 16) for _ in range(2)])
    hashes = [_hash(i) for i in range(3)]
    saves = [BlockJob(i + 1, h) for i, h in enumerate(hashes)]
    worker.bind_connector_metadata(msgspec.msgpack.encode(HashStoreMeta(saves=saves)))
    worker.wait_for_save()  # stored tail first: the CPU tier keeps blocks 0 and 1
    worker.store_tiers.drain()
    worker.build_output(set())
    assert worker.store_tiers.cpu.keys() == [hashes[1], hashes[0]]

    def load(block_ids: list[int]) -> None:
        jobs = [BlockJob(block_id, h) for block_id, h in zip(block_ids, hashes)]
        worker.bind_connector_metadata(msgspec.msgpack.encode(HashStoreMeta(loads={"r": jobs})))
        worker.start_load_kv()
        assert worker.build_output(set()).bytes_loaded == 3 * BLOCK_BYTES

    with caplog.at_level(logging.INFO, logger="tokenbus.kv_transfer.offloading"):
        load([5, 6, 7])
        load([4, 5, 6])  # within LOAD_LOG_INTERVAL_S of the first line: tallied, not logged
    lines = [r.getMessage() for r in caplog.records if "KV offload: loaded" in r.getMessage()]
    assert len(lines) == 1
    assert re.fullmatch(
        r"KV offload: loaded 0\.0 MiB in [\d.]+ ms, [\d.]+ GB/s "
        r"\(blocks: 1 from disk, 2 from RAM\)",
        lines[0],
    )
    for layer in worker.kv_caches:  # blocks 1-3 loaded into 4-6 (the second load)
        assert torch.equal(layer[:, 4:7], layer[:, 1:4])
    monkeypatch.setattr(offloading, "LOAD_LOG_INTERVAL_S", 0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenbus.kv_transfer.offloading"):
        load([5, 6, 7])  # the second load's blocks and this one's: a disk hit is not promoted
    assert "(blocks: 2 from disk, 4 from RAM)" in caplog.text
    worker.shutdown()


def test_a_warm_disk_tier_prefaults_the_pool_blocks_it_will_fill(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(PoolBytes, "prefault", lambda self, first, n: calls.append((first, n)))
    config = KVTransferConfig(
        "OffloadingConnector",
        kv_connector_extra_config={"cpu_bytes": 0, "disk_path": str(tmp_path)},
    )

    def start() -> OffloadingWorker:
        worker = OffloadingWorker(ConnectorContext(config, LAYOUT, "test"))
        worker.register_kv_caches([torch.zeros(2, 8, BLOCK, 2, 16) for _ in range(2)])
        if worker.prefault_thread is not None:
            worker.prefault_thread.join()
        return worker

    start().shutdown()
    assert calls == []  # an empty tier: nothing to prefault
    files = BlockFiles(tmp_path, LAYOUT.fingerprint())
    for i in range(3):
        files.write(_hash(i), _kv(i))
    start().shutdown()
    assert calls == [(1, 3)]  # a fresh pool's first blocks, as many as the tier holds
    monkeypatch.setattr(offloading, "PREFAULT_BYTES", 2 * BLOCK_BYTES)
    start().shutdown()
    assert calls[-1] == (1, 2)


def test_shutdown_flushes_the_queue_and_gives_up_when_stuck(tmp_path, monkeypatch, caplog):
    write = BlockFiles.write
    monkeypatch.setattr(
        BlockFiles, "write", lambda self, h, kv: (time.sleep(0.01), write(self, h, kv))[1]
    )
    store = _store(cpu_bytes=0, disk_path=str(tmp_path / "a"))
    for i in range(20):
        store.store(_hash(i), _kv(i))
    store.close()
    assert len(list((tmp_path / "a").rglob("*.safetensors"))) == 20
    store = _store(cpu_bytes=0, disk_path=str(tmp_path / "gc"))  # never closed: collected
    for i in range(10):
        store.store(_hash(i), _kv(i))
    del store
    gc.collect()
    assert len(list((tmp_path / "gc").rglob("*.safetensors"))) == 10

    release = threading.Event()
    monkeypatch.setattr(BlockFiles, "write", lambda self, h, kv: release.wait(10))
    monkeypatch.setattr(offloading, "FLUSH_TIMEOUT_S", 0.2)
    store = _store(cpu_bytes=0, disk_path=str(tmp_path / "b"))
    store.store(_hash(0), _kv(0))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tokenbus.kv_transfer.offloading"):
        store.close()
    assert time.monotonic() - started < 2 and "gave up flushing" in caplog.text
    release.set()


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"cpu_bytes": -1}, "cpu_bytes"),
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
        ({"cpu_bytes": True}, "cpu_bytes"),
        ({"disk_path": "/tmp/x", "disk_bytes": "-2GiB"}, "disk_bytes"),
        ({"disk_path": "/tmp/x", "disk_bytes": "12 parsecs"}, "disk_bytes"),
        ({"disk_path": "/tmp/x", "disk_bytes": 0}, "disk_bytes"),
        ({"disk_path": ""}, "disk_path"),
        ({"cpu_bytes": 0}, "cpu_bytes"),
        ({"cpu_byte": "1GiB"}, "cpu_byte"),
    ],
)
def test_bad_config_names_the_key(extra, key):
    with pytest.raises(ValueError, match=key):
        OffloadConfig.from_extra(extra)


def test_sizes_parse():
    config = OffloadConfig.from_extra(
        {"cpu_bytes": "2GiB", "disk_path": "/tmp/x", "disk_bytes": 4096}
    )
    assert (config.cpu_bytes, config.disk_bytes) == (2 << 30, 4096)
    assert OffloadConfig.from_extra({}) == OffloadConfig(1 << 30, None, 8 << 30)
