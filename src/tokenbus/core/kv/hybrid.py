"""The hybrid KV cache (L1, pure Python): one KV group per attention window, over ONE BlockPool.

A model whose layers mix sliding-window and full attention (Gemma 2/3, Mistral with a window,
Qwen2's max_window_layers) would hold, under KVCacheManager, every layer's K/V for the whole
context. Here (as vLLM V1's hybrid allocator: KVCacheCoordinator over one SingleTypeKVCacheManager
per group) layers of one window form KV groups of equal size (`plan_kv_groups`), and each group
has its own block table per request over the shared pool:

- a full-attention group's table is KVCacheManager's: append-only, block i holds tokens
  [i * bs, (i + 1) * bs);
- a sliding group's table stays positional too, but blocks that fell entirely out of the window
  of every query still to come (tokens < num_computed_tokens - window + 1) are replaced by the
  null block and freed while the request runs (`_drop_out_of_window`), so it holds about
  window / bs + 1 blocks at any context length.

Memory shrinks because groups share K/V tensors (the worker's side of `KVGroupLayout`): layer j of
every group reads and writes buffer j, so a pool block is one page of the j-th layer of all
groups, and a block a sliding group frees is a page any group may take next. Where layers differ
in K/V shape (Gemma 4's), groups of each shape share a buffer range of their own: a block is a
page of every range, and the group holding it uses its own shape's page.

Prefix caching stays correct across groups: a block's hash key carries its group (a sliding
group's block and a full group's block of the same tokens hold different layers), and a hit of n
blocks needs every full group's first n blocks and, for each sliding group, the blocks holding
the keys the first uncached query sees (those within the window of the hit's end); the hit is
the longest n every group agrees on (`get_computed_blocks`). Admission counts every group's new
blocks against the one pool's free blocks. Preemption frees every group's blocks.

The worker keeps block tables append-only: an entry replaced here by the null block keeps its old
id there, which attention never reads (it lies before the window) and never writes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenbus.core.kv.block import KVBlock
from tokenbus.core.kv.manager import skips_prefix_cache
from tokenbus.core.kv.tables import BlockTables
from tokenbus.utils import cdiv

if TYPE_CHECKING:
    from tokenbus.config import EngineConfig
    from tokenbus.core.request import Request
    from tokenbus.model_arch import ModelArch

# Per KV group: a request's blocks (one list per group, in KVGroupLayout.groups order).
GroupBlocks = list[list[KVBlock]]


@dataclass(frozen=True)
class KVGroup:
    """Layers of one attention window whose K/V share block tables."""

    window: int | None  # None: full attention
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVGroupLayout:
    """How a model's layers map onto KV groups and shared K/V buffers: layer `groups[g].layers[j]`
    uses buffer offsets[g] + j. Groups whose layers hold K/V of one shape share buffers from
    offset 0 of their own range (num_buffers in all); a model whose layers differ in KV heads or
    head size (Gemma 4's global layers) has a range per shape (`offsets`; (): every group at 0).
    A layer that reads another's K/V (`shared`: (layer, owner) pairs,
    ModelArch.kv_shared_layers) is in no group: it is placed where its owner is. A layer that
    holds no K/V (`stateless`: a recurrent or MLP-only layer, beside sliding ones in LFM3) is in
    none either, and has no place."""

    groups: tuple[KVGroup, ...]
    shared: tuple[tuple[int, int], ...] = ()
    offsets: tuple[int, ...] = ()
    stateless: tuple[int, ...] = ()

    def offset(self, group: int) -> int:
        return self.offsets[group] if self.offsets else 0

    @property
    def num_buffers(self) -> int:
        return max(self.offset(g) + len(group.layers) for g, group in enumerate(self.groups))

    @property
    def buffer_layers(self) -> tuple[int, ...]:
        """A layer of each buffer (whose K/V shape the buffer takes), in buffer order."""
        layers: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                layers.setdefault(self.offset(g) + j, layer)
        return tuple(layers[b] for b in range(self.num_buffers))

    @property
    def num_layers(self) -> int:
        """The decoder layers: the groups', those reading another's K/V, those holding none."""
        placed = sum(len(group.layers) for group in self.groups) + len(self.shared)
        return placed + len(self.stateless)

    def group_of(self, layer: int) -> int | None:
        """The KV group decoder layer `layer` attends through; None for one holding no K/V."""
        return None if layer in self.stateless else self.place(layer)[0]

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, buffer) of decoder layer `layer` (its owner's, for a layer sharing K/V)."""
        layer = dict(self.shared).get(layer, layer)
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, self.offset(g) + group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")


def plan_kv_groups(
    windows: Sequence[int | None],
    hybrid: bool = True,
    shared: tuple[tuple[int, int], ...] = (),
    shapes: Sequence[Hashable] = (),
    stateless: Sequence[int] = (),
) -> KVGroupLayout:
    """KV groups for layers of these sliding windows (None: full attention); the layers of
    `shared` ((layer, owner) pairs) read their owners' K/V and join no group, nor do those of
    `stateless` (no K/V at all); `shapes`: each layer's K/V shape where layers differ ((): one
    shape).

    One group of every layer when all windows and shapes agree, or with `hybrid` False (vLLM's
    --disable-hybrid-kv-cache-manager: every layer allocated as a global one, windows still
    masked). Otherwise the layers of each (window, shape) are cut into groups of the size of
    the smallest such set's layer count (Gemma 3's 5 local : 1 global: groups of the global
    layers' count), so the groups of one shape share that many buffers; a set whose count is
    not a multiple leaves its last group short (its unused buffer pages are the price of one
    page size). Groups of another shape take buffers of their own: a block a group holds
    leaves those pages unused in the other shapes' buffers."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    readers = {layer for layer, _ in shared}
    stateless = tuple(sorted(stateless))
    shape_of = list(shapes) or [None] * len(windows)
    own = {
        i: (window, shape_of[i])
        for i, window in enumerate(windows)
        if i not in readers and i not in stateless
    }
    if not own:
        raise ValueError("a model with KV groups needs at least one layer holding K/V")
    distinct = list(dict.fromkeys(own.values()))  # first-appearance order
    if len(distinct) == 1 or not hybrid:
        window = distinct[0][0] if len(distinct) == 1 else None
        return KVGroupLayout((KVGroup(window, tuple(own)),), shared, stateless=stateless)
    by_key = {key: tuple(i for i, x in own.items() if x == key) for key in distinct}
    size = min(len(layers) for layers in by_key.values())
    groups, group_shapes = [], []
    for (window, shape), layers in by_key.items():
        for start in range(0, len(layers), size):
            groups.append(KVGroup(window, layers[start : start + size]))
            group_shapes.append(shape)
    # each shape's buffers follow the previous shape's: as many as its largest group's layers
    ranges: dict[Hashable, int] = {}
    for group, shape in zip(groups, group_shapes):
        ranges[shape] = max(ranges.get(shape, 0), len(group.layers))
    starts, total = {}, 0
    for shape, count in ranges.items():
        starts[shape], total = total, total + count
    offsets = tuple(starts[shape] for shape in group_shapes) if len(ranges) > 1 else ()
    return KVGroupLayout(tuple(groups), shared, offsets, stateless)


def layer_windows(arch: ModelArch) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention)."""
    return list(arch.sliding_windows) or [None] * arch.num_hidden_layers


def engine_kv_groups(config: EngineConfig, arch: ModelArch) -> KVGroupLayout | None:
    """The engine's KV groups, or None: every layer full attention, on KVCacheManager as
    ever. A model with sliding windows gets them unless --disable-hybrid-kv-cache-manager, a KV
    connector (it moves one block table a request) or speculative decoding (its drafts share
    the target's single table) is configured: then one full-attention group, windows still
    masked, every block held."""
    windows = layer_windows(arch)
    if all(window is None for window in windows):
        return None
    hybrid = not (
        config.cache.disable_hybrid_kv_cache_manager
        or config.kv_transfer is not None
        or config.speculative is not None
    )
    if not hybrid:
        return None
    shapes = [arch.kv_shape(i) for i in range(arch.num_hidden_layers)]
    stateless = (*arch.recurrent_layers, *arch.mlp_only_layers)
    return plan_kv_groups(windows, hybrid, arch.kv_shared_layers, shapes, stateless)


class HybridKVCacheManager(BlockTables):
    """KVCacheManager's contract per KV group: allocate_slots, get_computed_blocks, free and
    the checks take and give one block list per group (GroupBlocks)."""

    req_to_blocks: dict[str, GroupBlocks]
    num_cached_blocks: dict[str, list[int]]  # per group

    def __init__(
        self, num_blocks: int, block_size: int, layout: KVGroupLayout, enable_caching: bool = True
    ) -> None:
        for group in layout.groups:
            if group.window is not None and group.window < 1:
                raise ValueError(f"sliding window must be >= 1, got {group.window}")
        super().__init__(num_blocks, block_size, enable_caching)
        self.layout = layout
        self.windows = layout.windows

    @staticmethod
    def _tables(entry: GroupBlocks) -> Sequence[list[KVBlock]]:
        return entry

    # ------------------------------------------------------------------ views
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (what a single-table reader sees: xray)."""
        return self.get_all_block_ids(request_id)[0]

    def get_all_block_ids(self, request_id: str) -> list[list[int]]:
        tables = self.req_to_blocks.get(request_id) or [[] for _ in self.windows]
        return [[block.block_id for block in table] for table in tables]

    @staticmethod
    def block_ids_per_group(blocks: GroupBlocks) -> list[list[int]]:
        """allocate_slots' result as ids, a list per group."""
        return [[block.block_id for block in group] for group in blocks]

    def num_held_blocks(self, group: int | None = None) -> int:
        """Pool blocks requests hold (null entries not counted), in `group` or in all."""
        groups = range(self.num_groups) if group is None else (group,)
        return sum(
            not block.is_null
            for tables in self.req_to_blocks.values()
            for g in groups
            for block in tables[g]
        )

    # ------------------------------------------------------------------ prefix cache
    def _key(self, group: int, block_hash: bytes) -> bytes:
        """A block's hash-map key: its tokens' chained hash and its group."""
        return block_hash + group.to_bytes(2, "little")

    def _cached(self, group: int, request: Request, index: int) -> KVBlock | None:
        return self.block_pool.get_cached_block(self._key(group, request.block_hashes[index]))

    def _first_needed_block(self, group: int, num_tokens: int) -> int:
        """The first block a query at position `num_tokens` (the first not yet computed) reads
        in `group`: 0 under full attention, else the block of key num_tokens - window + 1."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(num_tokens - window + 1, 0) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest prefix every group has cached: (per group, its hit blocks, null where a
        sliding group needs none; the number of hit tokens). As KVCacheManager's: call it for a
        request holding no blocks, pass the result to allocate_slots."""
        empty: GroupBlocks = [[] for _ in self.windows]
        if not self.enable_caching or skips_prefix_cache(request):
            return empty, 0
        num_hit = max(request.num_tokens - 1, 0) // self.block_size  # in blocks
        while True:  # shrink until every group agrees (a shorter hit may not suit a window)
            agreed = num_hit
            for group in range(self.num_groups):
                agreed = self._group_hit(group, request, agreed)
            if agreed == num_hit:
                break
            num_hit = agreed
        hits: GroupBlocks = []
        for group in range(self.num_groups):
            first = self._first_needed_block(group, num_hit * self.block_size)
            hits.append(
                [self.null_block] * first
                + [self._cached(group, request, i) for i in range(first, num_hit)]
            )
        num_hit_tokens = num_hit * self.block_size
        for stats in (self.prefix_cache_stats, self.total_prefix_cache_stats):
            stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)
        return hits, num_hit_tokens

    def _group_hit(self, group: int, request: Request, most: int) -> int:
        """The longest hit of at most `most` blocks this group can serve."""
        if self.windows[group] is None:  # chained hashes: a miss at i is a miss after
            for i in range(most):
                if self._cached(group, request, i) is None:
                    return i
            return most
        # A hit of n blocks needs blocks [first_needed(n), n) cached: scan from the right for
        # a long enough run of cached blocks (vLLM's SlidingWindowManager does the same).
        n = most
        while n > 0:
            first = self._first_needed_block(group, n * self.block_size)
            missing = next(
                (i for i in range(n - 1, first - 1, -1) if self._cached(group, request, i) is None),
                None,
            )
            if missing is None:
                return n
            n = missing  # any hit ending past the miss needs it
        return 0

    # ------------------------------------------------------------------ allocation
    def _drop_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding groups: free the blocks before the first block any later query reads."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return
        for group, table in enumerate(tables):
            end = min(self._first_needed_block(group, num_computed_tokens), len(table))
            dropped = []
            for i in range(end - 1, -1, -1):  # tail first, as `free`; stop at the earlier drops
                if table[i].is_null:
                    break
                dropped.append(table[i])
                table[i] = self.null_block
            self.block_pool.free_blocks(dropped)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
        cache_blocks: bool = True,
    ) -> GroupBlocks | None:
        """KVCacheManager.allocate_slots per group: the blocks appended to each group's table
        (hit blocks first), or None (changing nothing but out-of-window frees) if the new
        blocks of all groups together do not fit the pool."""
        if min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens) < 0:
            raise ValueError("allocate_slots: token counts must be >= 0")
        request_id = request.request_id
        hits = new_computed_blocks or [[] for _ in self.windows]
        if len(hits) != self.num_groups:
            raise ValueError(f"new_computed_blocks: expected {self.num_groups} groups")
        if any(hits) and request_id in self.req_to_blocks:
            raise ValueError(
                f"request {request_id!r} already holds blocks: "
                "prefix-hit blocks can only start a block table"
            )
        # What the queries from num_computed_tokens on no longer need goes back first: it may
        # be what lets this step fit.
        self._drop_out_of_window(request_id, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        tables = self.req_to_blocks.get(request_id) or [[] for _ in self.windows]
        counts, needed = [], 0
        for group, table in enumerate(tables):
            num_blocks = cdiv(num_slots, self.block_size) - len(table) - len(hits[group])
            # A fresh sliding table needs nothing before the window of its first new query.
            skipped = 0
            if not table and self.windows[group] is not None:
                skipped = max(self._first_needed_block(group, num_computed) - len(hits[group]), 0)
            counts.append((skipped, max(num_blocks - skipped, 0)))
            needed += counts[-1][1]
            needed += sum(1 for b in hits[group] if b.ref_cnt == 0 and not b.is_null)
        if needed > self.block_pool.num_free_blocks:
            return None
        added: GroupBlocks = []
        tables = self.req_to_blocks.setdefault(request_id, [[] for _ in self.windows])
        cached = self.num_cached_blocks.setdefault(request_id, [0] * self.num_groups)
        for group, (skipped, num_new) in enumerate(counts):
            self.block_pool.touch(hits[group])
            blocks = hits[group] + [self.null_block] * skipped
            blocks += self.block_pool.get_new_blocks(num_new)
            if hits[group]:
                cached[group] = len(hits[group])
            tables[group].extend(blocks)
            added.append(blocks)
        if self.enable_caching and cache_blocks:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return added

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        cached = self.num_cached_blocks[request.request_id]
        if len(request.block_hashes) < num_full:
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hashes "
                f"but {num_full} full blocks"
            )
        for group, table in enumerate(self.req_to_blocks[request.request_id]):
            for i in range(cached[group], num_full):
                block = table[i]
                if block.is_null:  # out of the window: nothing to register
                    continue
                assert block.block_hash is None, f"block {block.block_id} is already cached"
                block.block_hash = self._key(group, request.block_hashes[i])
                same = self.block_pool.cached_block_hash_to_block.setdefault(block.block_hash, {})
                same[block.block_id] = block
            cached[group] = max(cached[group], num_full)
