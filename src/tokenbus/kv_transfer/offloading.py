"""OffloadingConnector (L2): a CPU-RAM tier and an on-disk tier for K/V blocks, keyed by block
hash, so a prefix evicted from the pool is loaded back instead of recomputed, and the disk tier
is a persistent prefix cache: a server restarted on the same directory is warm at once.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
                           "kv_connector_extra_config": {"cpu_bytes": "4GiB",
                               "disk_path": "/var/cache/tokenbus-kv", "disk_bytes": "64GiB"}}'

Keys: block hashes chain from the first block, which carries the request's cache_salt, so no
tenant reads another's blocks; the files live in one directory per KVLayout.fingerprint(), so
another model, dtype or block size never hits.

Data flow (the HashStore shape): a block a step fills is copied to the CPU tier after the
forward and written through to disk by a background thread (a crash loses at most the queue);
a waiting request's next blocks that a tier holds are loaded before its forward, from the CPU
tier, else from the file, read straight into the pool and checksum-verified there (a disk hit
is not copied to the CPU tier: the page cache keeps a file read once about as close). Both
tiers are LRUs bounded in bytes; the worker half owns them. The scheduler half keeps an index
of the hashes either tier holds (the disk scan at start, then the worker's news: stored,
evicted from both tiers, dropped as unreadable), so `contains` costs no I/O. A block the index
claims that the worker cannot load is reported invalid and recomputed.

One engine per disk_path: engines sharing a directory stay correct (a file that vanished or
fails its checksum is a miss) but each bounds only the files it knows of.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from tokenbus.kv_transfer.base import ConnectorContext
from tokenbus.kv_transfer.block_bytes import BlockSpec, copy_into
from tokenbus.kv_transfer.block_files import BlockFiles
from tokenbus.kv_transfer.byte_lru import ByteLRU
from tokenbus.kv_transfer.hash_store import (
    HashStoreMeta,
    HashStoreNews,
    HashStoreScheduler,
    HashStoreWorker,
)
from tokenbus.utils import parse_size

if TYPE_CHECKING:
    from tokenbus.core.request import Request
    from tokenbus.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_BYTES = 1 << 30
DEFAULT_DISK_BYTES = 8 << 30
# Disk writes waiting past this are skipped (the block stays in the CPU tier only): a disk
# slower than the forward never grows the queue without bound.
MAX_QUEUED_WRITE_BYTES = 256 << 20
FLUSH_TIMEOUT_S = 30.0  # shutdown waits this long for queued disk writes, then gives up
# A used block's file gets a new mtime (its LRU position after a restart) at most this often.
MTIME_REFRESH_S = 10.0
LOAD_LOG_INTERVAL_S = 10.0  # the load throughput log line, at most this often
# At start, at most this much of the pool is made resident for the disk tier's first hits.
PREFAULT_BYTES = 256 << 20
_KEYS = ("cpu_bytes", "disk_path", "disk_bytes")


# ---------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class OffloadConfig:
    """kv_connector_extra_config of an OffloadingConnector, validated."""

    cpu_bytes: int  # bound of the CPU tier; 0: no CPU tier
    disk_path: str | None  # root of the disk tier (a directory per KV layout below it); None: none
    disk_bytes: int  # bound of the disk tier (the sizes of its files)

    @classmethod
    def from_extra(cls, extra: dict) -> OffloadConfig:
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown} for the "
                f"OffloadingConnector; known: {list(_KEYS)}"
            )
        disk_path = extra.get("disk_path")
        if disk_path is not None and (not isinstance(disk_path, str) or not disk_path):
            raise ValueError(
                f"kv_connector_extra_config.disk_path must be a directory (a non-empty "
                f"string), got {disk_path!r}"
            )
        config = cls(
            cpu_bytes=_size(extra, "cpu_bytes", DEFAULT_CPU_BYTES),
            disk_path=disk_path,
            disk_bytes=_size(extra, "disk_bytes", DEFAULT_DISK_BYTES),
        )
        if config.disk_path is None and config.cpu_bytes == 0:
            raise ValueError(
                "kv_connector_extra_config.cpu_bytes is 0 and there is no disk_path: "
                "the OffloadingConnector would hold nothing"
            )
        if config.disk_path is not None and config.disk_bytes == 0:
            raise ValueError(
                "kv_connector_extra_config.disk_bytes must be > 0 with a disk_path "
                "(leave disk_path out for no disk tier)"
            )
        return config


def _size(extra: dict, key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(
            f"kv_connector_extra_config.{key} must be a size in bytes (an int or a "
            f"string like '2GiB'), got {value!r}"
        )
    try:
        size = parse_size(value)
    except (ValueError, OverflowError):
        raise ValueError(
            f"kv_connector_extra_config.{key}: cannot parse size {value!r} "
            f"(e.g. 1073741824, '2GiB', '512MiB')"
        ) from None
    if size < 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be >= 0, got {value!r}")
    return size


# ---------------------------------------------------------------------- tiers
def scan_disk_tier(files: BlockFiles, disk_bytes: int) -> tuple[ByteLRU[float], list[bytes]]:
    """The disk tier's index from the files, oldest mtime first (hash → when this process last
    set its mtime: never), and the files past the bound (oldest first) to delete."""
    index: ByteLRU[float] = ByteLRU(disk_bytes)
    past_bound: list[bytes] = []
    for block_hash, size, _mtime in files.scan():
        past_bound += index.put(block_hash, float("-inf"), size)
    return index, past_bound


class OffloadMeta(HashStoreMeta):
    """HashStoreMeta plus the held blocks that admitted requests use (local prefix hits too),
    tail first, so the worker's LRUs see the use and keep a chain's head longest."""

    touches: list[bytes] = []


class OffloadNews(HashStoreNews):
    """HashStoreNews plus the blocks that left both tiers and the tiers' occupancy."""

    evicted: list[bytes] = []
    num_cpu_blocks: int = -1  # -1: unchanged since the last report
    disk_bytes: int = -1


_WRITE, _TOUCH, _SYNC, _STOP = "write", "touch", "sync", "stop"


class TieredStore:
    """The CPU tier, the disk tier and the thread that writes through to disk. Thread-safe: the
    forward thread stores and loads, the writer thread finishes writes; one lock keeps "held by
    a tier" exact, so a block is reported evicted exactly when it leaves the last one."""

    def __init__(self, config: OffloadConfig, layout_fingerprint: str) -> None:
        self._lock = threading.Lock()
        self.cpu: ByteLRU[torch.Tensor] = ByteLRU(config.cpu_bytes)
        self.disk: ByteLRU[float] = ByteLRU(0)  # hash → file size, and when we last set its mtime
        self._queued: dict[bytes, torch.Tensor] = {}  # given to the writer, not yet on disk
        self._queued_bytes = 0
        self._evicted: dict[bytes, None] = {}  # since the last take_news (an ordered set)
        self._num_skipped_writes = 0
        self.files: BlockFiles | None = None
        self._jobs: queue.SimpleQueue | None = None
        # Files whose mtime to refresh, sent to the writer as one job per step: a job per block
        # would wake the writer, and trade the GIL with it, once per block of a load.
        self._touches: list[bytes] = []
        self._flush = None
        if config.disk_path is not None:
            self.files = BlockFiles(config.disk_path, layout_fingerprint)
            self.disk, past_bound = scan_disk_tier(self.files, config.disk_bytes)
            for block_hash in past_bound:  # the bound shrank since the last run
                self.files.remove(block_hash)
            logger.info(
                "KV offload disk tier %s: %d blocks, %.1f MiB of %.1f MiB",
                self.files.dir,
                len(self.disk),
                self.disk.num_bytes / 2**20,
                config.disk_bytes / 2**20,
            )
            self._jobs = queue.SimpleQueue()
            writer = threading.Thread(
                target=_writer_loop,
                args=(self.files, self._jobs, weakref.ref(self)),
                name="tokenbus-kv-offload-writer",
                daemon=True,
            )
            writer.start()
            # Flushes on close(), when the store is collected, or at interpreter exit.
            self._flush = weakref.finalize(self, _flush_writer, self._jobs, writer)

    # ------------------------------------------------------------------ forward thread
    def store(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """Keep a block (a CPU copy) in the CPU tier and queue its write to disk."""
        kv = _own_cpu_copy(kv)
        nbytes = kv.numel() * kv.element_size()
        with self._lock:
            self._evicted.pop(block_hash, None)  # evicted and stored again since the last report
            if self._jobs is not None and block_hash not in self._queued:
                if self._queued_bytes + nbytes <= MAX_QUEUED_WRITE_BYTES:
                    self._queued[block_hash] = kv
                    self._queued_bytes += nbytes
                    self._jobs.put((_WRITE, block_hash, kv))
                else:
                    self._skipped_write()
            self._put_cpu(block_hash, kv)

    def load_into(self, block_hash: bytes, chunks: list[memoryview], spec: BlockSpec) -> str:
        """Write the block into `chunks` (its byte ranges, block_bytes) from the CPU tier, else
        straight from its file; returns the tier, "cpu" or "disk". Raises if no tier holds it
        (or its file is unreadable: then it is removed). A disk hit is not copied to the CPU
        tier: a file read once is in the page cache, which keeps it as close."""
        with self._lock:
            kv = self.cpu.get(block_hash)
            if kv is None:
                kv = self._queued.get(block_hash)
            on_disk = self._touch_disk(block_hash, time.monotonic())
        if kv is not None:
            copy_into(chunks, kv)
            return "cpu"
        if not on_disk:
            raise KeyError(f"KV block {block_hash.hex()[:16]} is in neither tier")
        try:
            self.files.read_into(block_hash, chunks, spec)  # a corrupt file is removed by it
        except Exception:
            with self._lock:
                self.disk.pop(block_hash)
            self.files.remove(block_hash)  # unreadable for any reason: never tried again
            raise
        return "disk"

    def touch(self, block_hashes: list[bytes]) -> None:
        """Mark blocks used, in order (the last becomes the most recently used), and hand the
        writer the mtimes to refresh (these and the loads' since the last call)."""
        now = time.monotonic()
        with self._lock:
            for block_hash in block_hashes:
                self.cpu.touch(block_hash)
                self._touch_disk(block_hash, now)
            self._send_touches()

    def take_news(self) -> tuple[list[bytes], int, int]:
        """(blocks that left both tiers since the last call, blocks in the CPU tier, disk bytes)."""
        with self._lock:
            evicted, self._evicted = list(self._evicted), {}
            return evicted, len(self.cpu), self.disk.num_bytes

    def drain(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every disk job queued so far is done (True), or `timeout_s` passed."""
        if self._jobs is None:
            return True
        done = threading.Event()
        with self._lock:
            self._send_touches()
        self._jobs.put((_SYNC, None, done))
        return done.wait(timeout_s)

    def close(self) -> None:
        """Flush the queued disk writes (bounded by FLUSH_TIMEOUT_S) and stop the writer."""
        if self._flush is not None:
            with self._lock:
                self._send_touches()
            self._flush()

    # ------------------------------------------------------------------ writer thread
    def _written(self, block_hash: bytes, nbytes: int) -> list[bytes]:
        """A write finished: index it; returns the files to delete to stay within the bound."""
        with self._lock:
            self._unqueue(block_hash)
            evicted = self.disk.put(block_hash, time.monotonic(), nbytes)
            for victim in evicted:
                self._left_a_tier(victim)
            return evicted

    def _write_failed(self, block_hash: bytes, exc: Exception) -> None:
        with self._lock:
            self._unqueue(block_hash)
            self._left_a_tier(block_hash)
        logger.warning(
            "KV offload: writing block %s to disk failed (%s); it stays in RAM only",
            block_hash.hex()[:16],
            exc,
        )

    # ------------------------------------------------------------------ under the lock
    def _touch_disk(self, block_hash: bytes, now: float) -> bool:
        """Move a file to the disk LRU's end (and, now and then, its mtime); False if absent."""
        mtime_set = self.disk.get(block_hash)
        if mtime_set is None:
            return False
        if now - mtime_set >= MTIME_REFRESH_S:  # its mtime orders the LRU after a restart
            self.disk.set_value(block_hash, now)
            self._touches.append(block_hash)
        return True

    def _send_touches(self) -> None:
        if self._touches:
            self._jobs.put((_TOUCH, None, self._touches))
            self._touches = []

    def _put_cpu(self, block_hash: bytes, kv: torch.Tensor) -> None:
        for victim in self.cpu.put(block_hash, kv, kv.numel() * kv.element_size()):
            self._left_a_tier(victim)

    def _left_a_tier(self, block_hash: bytes) -> None:
        if (
            block_hash not in self.cpu
            and block_hash not in self.disk
            and block_hash not in self._queued
        ):
            self._evicted[block_hash] = None

    def _unqueue(self, block_hash: bytes) -> None:
        kv = self._queued.pop(block_hash, None)
        if kv is not None:
            self._queued_bytes -= kv.numel() * kv.element_size()

    def _skipped_write(self) -> None:
        self._num_skipped_writes += 1
        if self._num_skipped_writes & (self._num_skipped_writes - 1) == 0:  # 1st, 2nd, 4th, …
            logger.warning(
                "KV offload: disk writes fall behind (%.0f MiB queued); %d blocks kept "
                "in RAM only so far",
                self._queued_bytes / 2**20,
                self._num_skipped_writes,
            )


def _own_cpu_copy(kv: torch.Tensor) -> torch.Tensor:
    """`kv` as a contiguous CPU tensor that owns exactly its storage (a view would keep the
    whole step's read alive)."""
    if (
        kv.device.type == "cpu"
        and kv.is_contiguous()
        and kv.untyped_storage().nbytes() == kv.numel() * kv.element_size()
    ):
        return kv
    if kv.device.type != "cpu":
        return kv.to("cpu").contiguous()
    return kv.clone(memory_format=torch.contiguous_format)


def _writer_loop(
    files: BlockFiles, jobs: queue.SimpleQueue, store_ref: weakref.ref[TieredStore]
) -> None:
    """Runs disk jobs in order until _STOP. Holds the store weakly: once it is collected the
    queued writes still land (their files are the next start's index), unindexed."""
    while True:
        op, block_hash, kv = jobs.get()
        if op == _STOP:
            return
        try:
            if op == _TOUCH:
                _refresh_mtimes(files, kv)
                continue
            if op == _SYNC:
                kv.set()  # the event drain() waits on
                continue
            try:
                nbytes = files.write(block_hash, kv)
            except OSError as exc:
                store = store_ref()
                if store is not None:
                    store._write_failed(block_hash, exc)
                continue
            store = store_ref()
            for victim in store._written(block_hash, nbytes) if store is not None else []:
                files.remove(victim)
            del store
        except Exception:  # never let the thread die: later writes and the flush need it
            logger.exception("KV offload: disk tier job %s failed", op)


def _refresh_mtimes(files: BlockFiles, block_hashes: list[bytes]) -> None:
    for block_hash in block_hashes:
        try:
            os.utime(files.path(block_hash))
        except FileNotFoundError:
            pass  # evicted meanwhile


def _flush_writer(jobs: queue.SimpleQueue, writer: threading.Thread) -> None:
    started = time.monotonic()
    jobs.put((_STOP, None, None))
    writer.join(FLUSH_TIMEOUT_S)
    if writer.is_alive():
        logger.warning(
            "KV offload: gave up flushing the disk tier after %.0f s with about %d jobs "
            "queued; those blocks are not on disk",
            time.monotonic() - started,
            jobs.qsize(),
        )


class LoadTally:
    """Loads since the last throughput line, logged at most every LOAD_LOG_INTERVAL_S (the
    first at once: after a restart, that is the load of the first warm prompt)."""

    def __init__(self) -> None:
        self._logged_at = -math.inf
        self._reset()

    def _reset(self) -> None:
        self.num_blocks = {"cpu": 0, "disk": 0}  # by the tier that served them
        self.num_bytes = 0
        self.seconds = 0.0

    def add(self, num_bytes: int, seconds: float) -> None:
        self.num_bytes += num_bytes
        self.seconds += seconds
        now = time.monotonic()
        if not num_bytes or now - self._logged_at < LOAD_LOG_INTERVAL_S:
            return
        logger.info(
            "KV offload: loaded %.1f MiB in %.1f ms, %.2f GB/s (blocks: %d from disk, %d from RAM)",
            self.num_bytes / 2**20,
            self.seconds * 1e3,
            self.num_bytes / max(self.seconds, 1e-9) / 1e9,
            self.num_blocks["disk"],
            self.num_blocks["cpu"],
        )
        self._logged_at = now
        self._reset()


# ---------------------------------------------------------------------- the connector's halves
class OffloadingScheduler(HashStoreScheduler):
    """The index of the hashes either tier holds; `contains` is a set lookup."""

    news_type = OffloadNews

    def __init__(self, ctx: ConnectorContext) -> None:
        self.config = OffloadConfig.from_extra(ctx.extra)
        self.block_nbytes = ctx.layout.block_nbytes
        self._index: set[bytes] = set()
        self._touches: list[bytes] = []
        self._num_cpu_blocks = 0
        self._disk_bytes = 0
        if self.config.disk_path is not None:
            # Same machine as the worker half: the same scan, bounded the same way.
            disk, _past_bound = scan_disk_tier(
                BlockFiles(self.config.disk_path, ctx.layout.fingerprint()), self.config.disk_bytes
            )
            self._index.update(disk.keys())
            self._disk_bytes = disk.num_bytes
        super().__init__(ctx, self._index.__contains__)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        num_used = (request.num_computed_tokens + num_external_tokens) // self.block_size
        self._touches.extend(
            h for h in reversed(request.block_hashes[:num_used]) if h in self._index
        )

    def make_meta(self, scheduler_output: SchedulerOutput) -> OffloadMeta | None:
        meta = super().make_meta(scheduler_output)
        touches, self._touches = self._touches, []
        if not touches:
            return meta
        if meta is None:
            return OffloadMeta(touches=touches)
        return OffloadMeta(loads=meta.loads, saves=meta.saves, touches=touches)

    def on_news(self, news: OffloadNews) -> None:
        # The worker cancels "evicted" for a block stored again in the same report, so
        # stored-then-removed is the right order.
        self._index.update(news.stored)
        self._index.difference_update(news.evicted)
        self._index.difference_update(news.dropped)
        if news.num_cpu_blocks >= 0:
            self._num_cpu_blocks = news.num_cpu_blocks
        if news.disk_bytes >= 0:
            self._disk_bytes = news.disk_bytes

    def tier_occupancy(self) -> dict[str, int]:
        tiers = {}
        if self.config.cpu_bytes:
            tiers["cpu"] = self._num_cpu_blocks * self.block_nbytes
        if self.config.disk_path is not None:
            tiers["disk"] = self._disk_bytes
        return tiers


class OffloadingWorker(HashStoreWorker):
    meta_type = OffloadMeta

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        config = OffloadConfig.from_extra(ctx.extra)
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            # Every rank would keep its own shard under the same hash, and only rank 0 reports.
            raise ValueError(
                "kv_transfer_config: the OffloadingConnector does not support tensor "
                "parallelism (world_size > 1) yet"
            )
        if 0 < config.cpu_bytes < ctx.layout.block_nbytes:
            logger.warning(
                "KV offload: cpu_bytes=%d holds no block (one is %d bytes)",
                config.cpu_bytes,
                ctx.layout.block_nbytes,
            )
        self.store_tiers = TieredStore(config, ctx.layout.fingerprint())
        self._occupancy_sent = (0, -1)
        self._loads = LoadTally()
        self.prefault_thread: threading.Thread | None = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        num_blocks = min(len(self.store_tiers.disk), PREFAULT_BYTES // self.block_spec.nbytes)
        if self.pool_bytes is not None and num_blocks:
            # A restart on a warm tier: its first hits load into a fresh pool, which hands out
            # blocks from id 1 up (core/kv's free queue starts in id order). Mapping those pages
            # now, beside the rest of the start, keeps their first touch (the larger part of
            # such a load, benchmarks/kv_tier_restart.py) off the first request.
            self.prefault_thread = threading.Thread(
                target=self.pool_bytes.prefault,
                args=(1, num_blocks),
                name="tokenbus-kv-prefault",
                daemon=True,
            )
            self.prefault_thread.start()

    def load_into(self, block_hash: bytes, chunks: list[memoryview]) -> None:
        tier = self.store_tiers.load_into(block_hash, chunks, self.block_spec)
        self._loads.num_blocks[tier] += 1

    def store(self, block_hash: bytes, kv: torch.Tensor) -> None:
        self.store_tiers.store(block_hash, kv)

    def start_load_kv(self) -> None:
        num_bytes, seconds = self.counters.bytes_loaded, self.counters.load_seconds
        super().start_load_kv()
        self._loads.add(
            self.counters.bytes_loaded - num_bytes, self.counters.load_seconds - seconds
        )
        self.store_tiers.touch(self._meta.touches)  # after the loads: a chain's head ends newest

    def wait_for_save(self) -> None:
        if self._skip_saves():
            return
        started = time.perf_counter()
        # One device → host copy for the step's blocks, then one CPU copy each.
        # [L, 2, n, bs, Hkv, D]
        kv = self.read_blocks([job.block_id for job in self._meta.saves]).to("cpu")
        # Tail blocks first: the LRUs then drop a chain from its tail, never its head.
        for i in reversed(range(len(self._meta.saves))):
            self.store_or_drop(self._meta.saves[i].block_hash, kv[:, :, i])
        self.counters.timed_save(kv.numel() * kv.element_size(), started)

    def worker_meta(self) -> bytes | None:
        evicted, num_cpu_blocks, disk_bytes = self.store_tiers.take_news()
        occupancy = (num_cpu_blocks, disk_bytes)
        if not (self._stored or self._dropped or evicted) and occupancy == self._occupancy_sent:
            return None
        news = OffloadNews(
            stored=self._stored,
            dropped=self._dropped,
            evicted=evicted,
            num_cpu_blocks=num_cpu_blocks,
            disk_bytes=disk_bytes,
        )
        self._stored, self._dropped, self._occupancy_sent = [], [], occupancy
        return msgspec.msgpack.encode(news)

    def shutdown(self) -> None:
        self.store_tiers.close()
