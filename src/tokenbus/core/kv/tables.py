"""BlockTables: what both KV cache managers share (L1, pure Python).

One BlockPool; each request's block tables, one per KV group (`KVCacheManager` has one group,
`HybridKVCacheManager` several); the prefix-cache counters; freeing; the leak checks. The
managers differ in how they find hits and hand out blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tokenbus.core.kv.block import KVBlock
from tokenbus.core.kv.block_pool import BlockPool, require
from tokenbus.core.kv.stats import PrefixCacheStats

if TYPE_CHECKING:
    from tokenbus.core.request import Request


class BlockTables:
    # request id → its tables, in the manager's own shape (`_tables` reads them per group).
    req_to_blocks: dict[str, Any]
    # request id → how many leading blocks of its table(s) are registered in the hash map.
    num_cached_blocks: dict[str, Any]

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks = {}
        self.num_cached_blocks = {}
        self.prefix_cache_stats = PrefixCacheStats()  # since the last make_prefix_cache_stats()
        self.total_prefix_cache_stats = PrefixCacheStats()  # since start-up

    @staticmethod
    def _tables(entry: Any) -> Sequence[list[KVBlock]]:
        """A request's entry in `req_to_blocks` as one block list per group."""
        raise NotImplementedError

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def null_block(self) -> KVBlock:
        return self.block_pool.null_block

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks full up to ``num_tokens`` (e.g. after a KV load)."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))

    def evict_cached_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the hashes of blocks whose KV is wrong (a failed load): nobody may hit them.
        Requests holding them must be freed (preempted or failed) before the next step."""
        for block_id in block_ids:
            if 0 < block_id < self.block_pool.num_blocks:
                self.block_pool.evict_cached_hash(self.block_pool.blocks[block_id])

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted) and forget it."""
        entry = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        # Each table tail first: hashed blocks are appended to the LRU queue in this order, so
        # the last block is evicted before the first and a cached block keeps its ancestors (a
        # chained hash can only be hit through its whole prefix).
        for table in self._tables(entry) if entry is not None else ():
            self.block_pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (e.g. after a weight update); False while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The counters since the last call; starts a new interval."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def check_consistency(self) -> None:
        """Raise AssertionError unless ref counts match the entries of every table (valid
        mid-workload)."""
        self.block_pool.check_consistency()
        num_holders = Counter(
            block.block_id
            for entry in self.req_to_blocks.values()
            for table in self._tables(entry)
            for block in table
            if not block.is_null
        )
        for block in self.block_pool.blocks[1:]:
            require(
                block.ref_cnt == num_holders[block.block_id],
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{num_holders[block.block_id]} block-table entries",
            )

    def check_integrity(self) -> None:
        """Raise AssertionError unless the cache is idle and whole: the check after a workload.

        No request holds blocks, every block but the null block is in the free queue exactly
        once, every ref count is 0.
        """
        require(
            not self.req_to_blocks, f"requests still hold KV blocks: {sorted(self.req_to_blocks)}"
        )
        self.check_consistency()
        num_usable = self.block_pool.num_blocks - 1
        require(
            self.num_free_blocks == num_usable,
            f"{num_usable - self.num_free_blocks} KV blocks leaked: "
            f"{self.num_free_blocks} of {num_usable} are free",
        )
