"""KV from outside the pool, as the scheduler sees it (L1, no torch).

`ExternalKV` owns the scheduler's side of a KV connector (kv_transfer/, seen through
core/sched/ports.KVConnectorScheduler): which tokens the connector offers a waiting request,
the asynchronous loads in flight, the finished requests whose blocks it still reads (sending) or
writes (an aborted load), and the step's external prefix-cache and transfer figures. Without a
connector it only frees finished requests' blocks.

A waiting request may get tokens from the connector:
- synchronously: the worker loads them before the step's forward; they count as computed at
  once and the rest of the prompt is scheduled in the same step;
- asynchronously (`start_load`): the request takes its blocks and waits in
  WAITING_FOR_REMOTE_KVS, holding nobody up, until the worker reports the load done
  (`finish_transfers`); then it runs like a resumed request. If the whole prompt came in, its
  last token is computed again for its logits.
An offered hit counts in the stats only once its tokens have loaded (`settle_hits`).

The seam with the scheduler: this class changes requests' KV state (blocks, computed tokens,
cached hashes) and its own tables; it never touches the running or waiting queues. Where a load
fails (`invalid_block_ids`), the scheduler walks the requests on bad blocks: this class evicts
the bad hashes, marks each request and truncates an asynchronous load that can go on
(`holders_of_bad_blocks`, `quarantine`, `truncate_load`, `abandon_load`); the scheduler takes
the others out of their queue and fails or requeues them, one request at a time, so that each
request's hashes are evicted just before it is freed, in the order they always were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tokenbus.core.kv import KVBlock, KVCacheManager
from tokenbus.core.kv.manager import skips_prefix_cache
from tokenbus.core.outputs import KVConnectorOutput
from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.core.sched.ports import KVConnectorScheduler


class ExternalKV:
    def __init__(
        self, kv_cache_manager: KVCacheManager, connector: KVConnectorScheduler | None
    ) -> None:
        self.kv = kv_cache_manager
        self.connector = connector
        # req_id → tokens its asynchronous connector load provides (WAITING_FOR_REMOTE_KVS).
        self._remote_loads: dict[str, int] = {}
        # Finished requests whose blocks the connector's worker half still reads (sending) or
        # writes (an aborted load): freed when the worker reports that request done.
        self._delayed_free: dict[str, Request] = {}
        self._external_queries_step = 0
        self._external_hits_step = 0
        # req_id → external tokens it was offered at admission: a hit only once they loaded.
        self._pending_external_hits: dict[str, int] = {}
        self._kv_output_step: KVConnectorOutput | None = None

    # ------------------------------------------------------------------ finished requests
    def is_delayed_free(self, req_id: str) -> bool:
        return req_id in self._delayed_free

    def has_delayed_free(self) -> bool:
        return bool(self._delayed_free)

    @property
    def delayed_free_request_ids(self) -> list[str]:
        """Finished requests whose blocks a connector still reads or writes."""
        return list(self._delayed_free)

    def release(self, request: Request, keep_blocks: bool) -> None:
        """A finished request: free its blocks now, or once the connector is done with them
        (`keep_blocks`: a load in flight still writes into them)."""
        delay_free = keep_blocks
        if self.connector is not None:
            delay, request.kv_transfer_params_out = self.connector.request_finished(
                request, self.kv.get_block_ids(request.request_id)
            )
            delay_free = delay_free or delay
        self._remote_loads.pop(request.request_id, None)
        self._pending_external_hits.pop(request.request_id, None)  # never loaded: no hit
        if delay_free and self.kv.holds_blocks(request.request_id):
            self._delayed_free[request.request_id] = request
        else:
            self.kv.free(request)

    # ------------------------------------------------------------------ admission
    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """What the connector can provide past the local prefix hit: (tokens, asynchronously?)."""
        if self.connector is None or skips_prefix_cache(request) or request.kv_load_failed:
            return 0, False
        return self.connector.get_num_new_matched_tokens(request, num_computed)

    def admitted(self, request: Request, num_computed: int, num_external: int) -> None:
        """`request` got its blocks and runs this step; the worker loads `num_external` tokens
        after its `num_computed` local ones before the forward."""
        self._count_query(request, num_computed, num_external)
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.request_id), num_external
            )

    def start_load(
        self,
        request: Request,
        num_computed: int,
        computed_blocks: Sequence[KVBlock],
        num_external: int,
    ) -> bool:
        """Allocate the blocks an asynchronous load fills; not cached until it has. False (and
        nothing changed) when they do not fit."""
        new_blocks = self.kv.allocate_slots(
            request, num_external, num_computed, computed_blocks, cache_blocks=False
        )
        if new_blocks is None:
            return False
        self._count_query(request, num_computed, num_external)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._remote_loads[request.request_id] = num_external
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_external
        )
        return True

    def attach_connector_meta(self, output: SchedulerOutput) -> None:
        """Attach what the worker half must load and save this step."""
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)

    # ------------------------------------------------------------------ the worker's report
    def receive_report(self, kv_output: KVConnectorOutput | None) -> None:
        """The worker half's report of the last step (None: no connector output): kept for
        this step's stats, handed to the connector."""
        self._kv_output_step = kv_output
        if kv_output is not None and self.connector is not None:
            self.connector.update_connector_output(kv_output)

    def finish_transfers(
        self, kv_output: KVConnectorOutput, failed: set[str], requests: Mapping[str, Request]
    ) -> None:
        """Loads and sends the worker reports done. A request whose load ended keeps its place
        in the waiting queue and is admitted there next step; `failed` ones recompute instead."""
        for req_id in kv_output.finished_recving:
            if req_id in self._delayed_free:  # aborted while loading: now nothing writes its blocks
                self.kv.free(self._delayed_free.pop(req_id))
                continue
            request = requests.get(req_id)
            num_external = self._remote_loads.pop(req_id, None)
            if request is None or num_external is None or req_id in failed:
                self._pending_external_hits.pop(req_id, None)
                continue
            # What came in: all it was offered, or the part before a failed block.
            self._confirm_hit(req_id, num_external)
            request.num_computed_tokens += num_external
            if request.num_computed_tokens >= request.num_tokens:
                request.num_computed_tokens = request.num_tokens - 1  # compute the last for logits
            self.kv.cache_blocks(request, request.num_computed_tokens)
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.WAITING  # admitted in its place next step
        for req_id in kv_output.finished_sending:
            request = self._delayed_free.pop(req_id, None)
            if request is not None:
                self.kv.free(request)

    def settle_hits(self, scheduled_req_ids: Iterable[str], failed: set[str]) -> None:
        """The step ran: a synchronous load offered to a request scheduled in it came in,
        unless its blocks were reported bad (`failed`)."""
        for req_id in scheduled_req_ids:
            if req_id in failed:
                self._pending_external_hits.pop(req_id, None)
            elif req_id in self._pending_external_hits:  # a synchronous load, done in the step
                self._confirm_hit(req_id, self._pending_external_hits[req_id])

    # ------------------------------------------------------------------ failed loads
    def holders_of_bad_blocks(
        self, invalid: set[int], requests: Iterable[Request]
    ) -> list[Request]:
        """Forget the hashes of the blocks whose load failed (nobody may hit them); the
        requests that hold one, found before any of them is moved."""
        self.kv.evict_cached_blocks(invalid)
        return [
            request
            for request in requests
            if invalid.intersection(self.kv.get_block_ids(request.request_id))
        ]

    def quarantine(self, request: Request, invalid: set[int]) -> None:
        """`request` holds a bad block: it never asks the connector again (it computes)."""
        request.kv_load_failed = True
        # A block computed in the same step read the bad one: its K/V is wrong as well, and
        # must not stay findable under its hash (a chained hash is hit again once the bad
        # block's hash is cached anew).
        block_ids = self.kv.get_block_ids(request.request_id)
        self.kv.evict_cached_blocks(block_ids[_first_index_in(block_ids, invalid) :])

    def truncate_load(self, request: Request, invalid: set[int]) -> bool:
        """An asynchronous load that failed in part: keep the blocks before the first bad one
        (its finished_recving comes in the same report), compute the rest. False if `request`
        has no load in flight."""
        if request.request_id not in self._remote_loads:
            return False
        first_bad = _first_index_in(self.kv.get_block_ids(request.request_id), invalid)
        valid_tokens = max(first_bad * self.kv.block_size, request.num_computed_tokens)
        self._remote_loads[request.request_id] = valid_tokens - request.num_computed_tokens
        return True

    def abandon_load(self, req_id: str, recving: set[str]) -> bool:
        """Forget `req_id`'s load; True if it is still in flight (its end not in this report):
        it still writes into the request's blocks, which must be kept until it ends."""
        loading = req_id in self._remote_loads and req_id not in recving
        self._remote_loads.pop(req_id, None)
        return loading

    # ------------------------------------------------------------------ stats and checks
    def transfer_stats(self) -> dict:
        """The SchedulerStats fields of the step; starts a new one."""
        stats: dict = {}
        if self.connector is not None:
            stats.update(
                external_prefix_cache_queries=self._external_queries_step,
                external_prefix_cache_hits=self._external_hits_step,
                kv_tier_bytes=self.connector.tier_occupancy(),
            )
            self._external_queries_step = self._external_hits_step = 0
        out, self._kv_output_step = self._kv_output_step, None
        if out is not None:
            stats.update(
                kv_bytes_loaded=out.bytes_loaded,
                kv_bytes_saved=out.bytes_saved,
                kv_load_seconds=out.load_seconds,
                kv_save_seconds=out.save_seconds,
            )
        return stats

    def check_integrity(self) -> None:
        """After all requests finished: no blocks held, no load or hit left."""
        assert not self._delayed_free, (
            f"blocks still held for KV transfer: {list(self._delayed_free)}"
        )
        assert not self._remote_loads, f"KV loads still tracked: {list(self._remote_loads)}"
        assert not self._pending_external_hits, (
            f"external hits never settled: {list(self._pending_external_hits)}"
        )

    # ------------------------------------------------------------------ counters
    def _count_query(self, request: Request, num_computed: int, num_external: int) -> None:
        """Once per request, when it is admitted (not each step it waits for room). Its hit
        counts once the load has succeeded (_confirm_hit), not when it is offered."""
        if (
            self.connector is not None
            and request.num_cached_tokens is None
            and not request.kv_load_failed
        ):
            self._external_queries_step += request.num_tokens - num_computed
            if num_external > 0:
                self._pending_external_hits[request.request_id] = num_external

    def _confirm_hit(self, req_id: str, num_loaded: int) -> None:
        """`num_loaded` of the tokens offered to `req_id` at its admission came in."""
        if self._pending_external_hits.pop(req_id, None) is not None:
            self._external_hits_step += num_loaded


def _first_index_in(block_ids: list[int], wanted: set[int]) -> int:
    """The position of the first of `block_ids` in `wanted` (one is)."""
    return next(i for i, block_id in enumerate(block_ids) if block_id in wanted)
