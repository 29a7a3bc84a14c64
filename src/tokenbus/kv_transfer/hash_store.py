"""A connector over a store of blocks keyed by block hash (L2): the shared half of
SharedStorageConnector (files) and OffloadingConnector (CPU RAM, then disk).

Scheduler half: a waiting request's next full blocks that the store holds (consecutive from
its local prefix hit, at most num_tokens - 1 tokens) are loaded synchronously before the step's
forward; every block that a step fills is saved after the forward unless the store has it.
The store decides membership (`contains`); the worker half reports what it stored and what
it found corrupt (dropped), so an index kept by the scheduler half stays true.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from tokenbus.kv_transfer.base import ConnectorContext, KVConnectorWorker
from tokenbus.kv_transfer.block_bytes import StagedBlocks, copy_into

if TYPE_CHECKING:
    import torch

    from tokenbus.core.outputs import KVConnectorOutput
    from tokenbus.core.request import Request
    from tokenbus.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


class BlockJob(msgspec.Struct, array_like=True):
    block_id: int  # in this instance's pool
    block_hash: bytes


class HashStoreMeta(msgspec.Struct, array_like=True, omit_defaults=True):
    loads: dict[str, list[BlockJob]] = {}  # req_id → blocks to fill before the forward
    saves: list[BlockJob] = []  # blocks full after this step, to store after the forward


class HashStoreNews(msgspec.Struct, array_like=True, omit_defaults=True):
    """Worker → scheduler: hashes now in the store, and ones found bad (and removed)."""

    stored: list[bytes] = []
    dropped: list[bytes] = []


class HashStoreScheduler:
    """KVConnectorScheduler over a store; `contains(hash)` answers membership."""

    news_type: type[HashStoreNews] = HashStoreNews  # a subclass's worker half may report more

    def __init__(self, ctx: ConnectorContext, contains: Callable[[bytes], bool]) -> None:
        self.ctx = ctx
        self.block_size = ctx.layout.block_size
        self.contains = contains
        self._requests: dict[str, Request] = {}
        self._tables: dict[str, list[int]] = {}  # req_id → its block table, as the worker has it
        self._num_considered: dict[
            str, int
        ] = {}  # req_id → leading blocks already saved or skipped
        self._loads: dict[str, list[BlockJob]] = {}
        self._saving: set[bytes] = set()  # sent to the worker, not yet reported stored

    # ------------------------------------------------------------------ lookups
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.ctx.config.is_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = max(request.num_tokens - 1, 0) // self.block_size  # the last token is computed
        num_blocks = 0
        for block_hash in request.block_hashes[first:last]:
            if not self.contains(block_hash):
                break  # chained hashes: the rest cannot follow a miss
            num_blocks += 1
        return num_blocks * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens:
            first = request.num_computed_tokens // self.block_size
            end = first + num_external_tokens // self.block_size
            self._loads[request.request_id] = [
                BlockJob(block_ids[i], request.block_hashes[i]) for i in range(first, end)
            ]

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes | None:
        meta = self.make_meta(scheduler_output)
        return None if meta is None else msgspec.msgpack.encode(meta)

    def make_meta(self, scheduler_output: SchedulerOutput) -> HashStoreMeta | None:
        """This step's metadata (a subclass may add to it); None: nothing to do."""
        loads, self._loads = self._loads, {}
        saves = self._plan_saves(scheduler_output) if self.ctx.config.is_producer else []
        if not loads and not saves:
            return None
        return HashStoreMeta(loads=loads, saves=saves)

    def _plan_saves(self, so: SchedulerOutput) -> list[BlockJob]:
        for new in so.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids)
            self._num_considered[new.req_id] = 0
        for cached in so.scheduled_cached_reqs:
            self._tables.setdefault(cached.req_id, []).extend(cached.new_block_ids)
        saves = []
        for req_id, num_new in so.num_scheduled_tokens.items():
            request, table = self._requests.get(req_id), self._tables.get(req_id)
            if request is None or table is None:
                continue
            # num_computed_tokens has not advanced yet; drafts past num_tokens are unverified.
            num_full = (
                min(request.num_computed_tokens + num_new, request.num_tokens) // self.block_size
            )
            for i in range(self._num_considered.get(req_id, 0), min(num_full, len(table))):
                block_hash = request.block_hashes[i]
                if block_hash not in self._saving and not self.contains(block_hash):
                    saves.append(BlockJob(table[i], block_hash))
                    self._saving.add(block_hash)
            self._num_considered[req_id] = max(self._num_considered.get(req_id, 0), num_full)
        return saves

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if output.worker_meta is None:
            return
        news = msgspec.msgpack.decode(output.worker_meta, type=self.news_type)
        # Dropped: a save that was skipped or failed is not in the store either.
        self._saving.difference_update(news.stored)
        self._saving.difference_update(news.dropped)
        self.on_news(news)

    def on_news(self, news: HashStoreNews) -> None:
        """A subclass with an index updates it here."""

    def tier_occupancy(self) -> dict[str, int]:
        return {}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Its last step's saves ran before that step returned: nothing holds its blocks.
        for table in (self._requests, self._tables, self._num_considered, self._loads):
            table.pop(request.request_id, None)
        return False, None


class HashStoreWorker(KVConnectorWorker):
    """Worker half: `load_into(hash, chunks)` writes a block's K/V where `chunks` say (the
    pool's bytes, or a staging tensor's) or raises; `store` keeps one. Both synchronous (a
    subclass may defer the slow part of a store)."""

    meta_type: type[HashStoreMeta] = HashStoreMeta  # what its scheduler half's make_meta builds

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self._meta = self.meta_type()
        self._stored: list[bytes] = []
        self._dropped: list[bytes] = []
        self._load_failed = False  # this step: a block did not load, the forward read it anyway

    def load(self, block_hash: bytes) -> torch.Tensor:
        raise NotImplementedError

    def load_into(self, block_hash: bytes, chunks: list[memoryview]) -> None:
        """Write a block's K/V into `chunks`, its byte ranges in [L, 2, bs, Hkv, row] order
        (block_bytes), or raise. This one copies what load() returns; a store that can read in
        place overrides it."""
        kv = self.load(block_hash)
        self._check_block(kv)
        copy_into(chunks, kv)

    def store(self, block_hash: bytes, kv: torch.Tensor) -> None:
        raise NotImplementedError

    def bind_connector_metadata(self, metadata: bytes | None) -> None:
        self._meta = (
            self.meta_type()
            if metadata is None
            else msgspec.msgpack.decode(metadata, type=self.meta_type)
        )

    def start_load_kv(self) -> None:
        self._load_failed = False
        for jobs in self._meta.loads.values():
            started = time.perf_counter()
            # Straight into the pool when it is CPU memory; else staged, then one copy to it.
            staged = (
                None if self.pool_bytes is not None else StagedBlocks(self.block_spec, len(jobs))
            )
            num_loaded = 0
            for i, job in enumerate(jobs):
                chunks = (
                    staged.block_chunks(i)
                    if staged is not None
                    else self.pool_bytes.block_chunks(job.block_id)
                )
                try:
                    self.load_into(job.block_hash, chunks)
                except Exception:  # missing, corrupt, unreadable: a miss, never wrong K/V
                    # The blocks after it chain from it: they are recomputed anyway.
                    self.counters.invalid_block_ids.update(j.block_id for j in jobs[i:])
                    self._dropped.append(job.block_hash)
                    self._load_failed = True
                    break
                num_loaded += 1
            if num_loaded:
                if staged is not None:
                    block_ids = [job.block_id for job in jobs[:num_loaded]]
                    self.write_blocks(block_ids, staged.tensor[:, :, :num_loaded])
                self.counters.timed_load(num_loaded * self.block_spec.nbytes, started)

    def _check_block(self, kv: torch.Tensor) -> None:
        """A loaded block must fit the pool: [L, 2, bs, Hkv, row] of its storage dtype."""
        layout = self.ctx.layout
        dtype = str(kv.dtype).removeprefix("torch.")
        if list(kv.shape) != layout.block_shape or dtype != layout.storage_dtype:
            raise ValueError(
                f"stored block is {dtype} {list(kv.shape)}, the pool's {layout.dtype} "
                f"({layout.storage_dtype}) {layout.block_shape}"
            )

    def wait_for_save(self) -> None:
        if self._skip_saves():
            return
        started = time.perf_counter()
        kv = self.read_blocks([job.block_id for job in self._meta.saves])  # [L, 2, n, bs, Hkv, D]
        for i, job in enumerate(self._meta.saves):
            self.store_or_drop(job.block_hash, kv[:, :, i])
        self.counters.timed_save(kv.numel() * kv.element_size(), started)

    def _skip_saves(self) -> bool:
        """True when this step saves nothing. After a failed load every save is dropped: the
        forward read the block that did not load, so what it computed is wrong as well (the
        scheduler recomputes those requests; their blocks are saved then)."""
        if self._meta.saves and self._load_failed:
            self._dropped.extend(job.block_hash for job in self._meta.saves)
            return True
        return not self._meta.saves

    def store_or_drop(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """Store one block; a store that fails (disk full, …) loses that block, not the engine."""
        try:
            self.store(block_hash, kv)
        except Exception:
            logger.exception(
                "KV connector: storing block %s failed; it stays out of the store",
                block_hash.hex()[:16],
            )
            self._dropped.append(block_hash)
            return
        self._stored.append(block_hash)

    def worker_meta(self) -> bytes | None:
        if not self._stored and not self._dropped:
            return None
        news = HashStoreNews(stored=self._stored, dropped=self._dropped)
        self._stored, self._dropped = [], []
        return msgspec.msgpack.encode(news)
