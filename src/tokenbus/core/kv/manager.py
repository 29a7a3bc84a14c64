"""KVCacheManager: block tables per request over one BlockPool. The scheduler's only KV view."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenbus.core.kv.block import KVBlock
from tokenbus.core.kv.block_pool import require
from tokenbus.core.kv.tables import BlockTables
from tokenbus.utils import cdiv

if TYPE_CHECKING:
    from tokenbus.core.request import Request


class KVCacheManager(BlockTables):
    """Hands out blocks to requests, finds prefix-cache hits, takes blocks back.

    A request's block table is append-only while it runs: block i holds the KV of tokens
    [i * block_size, (i + 1) * block_size), so ``slot = block_id * block_size + pos % block_size``.
    The manager never changes ``request.num_computed_tokens``: the scheduler owns it.
    """

    req_to_blocks: dict[str, list[KVBlock]]
    num_cached_blocks: dict[str, int]

    @staticmethod
    def _tables(entry: list[KVBlock]) -> Sequence[list[KVBlock]]:
        return (entry,)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    # The scheduler's view per KV group (one here; core/kv/hybrid.py has several).
    def get_all_block_ids(self, request_id: str) -> list[list[int]]:
        return [self.get_block_ids(request_id)]

    @staticmethod
    def block_ids_per_group(blocks: Sequence[KVBlock]) -> list[list[int]]:
        """allocate_slots' result as ids, a list per group."""
        return [[block.block_id for block in blocks]]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``request``: (hit blocks, number of hit tokens).

        Call it for a request holding no blocks (``num_computed_tokens == 0``); pass the result
        to ``allocate_slots``. The hit blocks are not referenced until then.
        """
        if not self.enable_caching or skips_prefix_cache(request):
            return [], 0
        # The last token is always recomputed to get its logits: the hit stops at num_tokens - 1,
        # rounded down to whole blocks (a cached 32-token prompt hits 1 block of 16).
        max_num_hit_blocks = max(request.num_tokens - 1, 0) // self.block_size
        hit_blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # hashes are chained: a miss at block i is a miss at every later block
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        for stats in (self.prefix_cache_stats, self.total_prefix_cache_stats):
            stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)
        return hit_blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
        cache_blocks: bool = True,
    ) -> list[KVBlock] | None:
        """Give ``request`` slots for this step; None (changing nothing) if they don't fit.

        Token layout of the request after this call::

            | computed | new_computed | new | lookahead |
              request.num_computed_tokens, then num_new_computed_tokens prefix-hit tokens (in
              new_computed_blocks), num_new_tokens to compute now, num_lookahead_tokens draft slots.

        Returns the blocks appended to the request's table (hit blocks first, then new ones):
        the scheduler sends their ids to the worker. ``cache_blocks=False`` registers no new
        full block yet: a KV connector fills them asynchronously (``cache_blocks`` once loaded).
        """
        if min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens) < 0:
            raise ValueError("allocate_slots: token counts must be >= 0")
        hit_blocks = list(new_computed_blocks or ())
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if hit_blocks and req_blocks:
            raise ValueError(
                f"request {request.request_id!r} already holds blocks: "
                "prefix-hit blocks can only start a block table"
            )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_with_slots = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_new_blocks = max(
            cdiv(num_tokens_with_slots, self.block_size) - len(req_blocks) - len(hit_blocks), 0
        )
        # Hit blocks nobody holds sit in the free queue: touching them takes them out of it.
        num_free_hit_blocks = sum(
            1 for block in hit_blocks if block.ref_cnt == 0 and not block.is_null
        )
        if num_new_blocks + num_free_hit_blocks > self.block_pool.num_free_blocks:
            return None

        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if hit_blocks:
            # Hit blocks are cached already; they come first in an empty table.
            self.num_cached_blocks[request.request_id] = len(hit_blocks)
        req_blocks.extend(hit_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and cache_blocks:
            # Cache every block full once this step is computed, so that other requests in the
            # same step can hit it (within a layer, every KV write precedes every read). Capped
            # at num_tokens: lookahead/draft tokens are unverified and never cached.
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, num_tokens_to_cache)
        return hit_blocks + new_blocks

    def check_consistency(self) -> None:
        """BlockTables' checks, and every block a request counts as cached is hashed."""
        super().check_consistency()
        for request_id, num_cached in self.num_cached_blocks.items():
            blocks = self.req_to_blocks.get(request_id, [])
            require(
                num_cached <= len(blocks)
                and all(
                    block.block_hash is not None or block.is_null for block in blocks[:num_cached]
                ),
                f"request {request_id!r}: {num_cached} cached blocks claimed, not all hashed",
            )

    def _cache_full_blocks(self, request: Request, num_tokens_to_cache: int) -> None:
        """Register the request's blocks that are full up to ``num_tokens_to_cache``."""
        request_id = request.request_id
        num_cached_blocks = self.num_cached_blocks.get(request_id, 0)
        num_full_blocks = num_tokens_to_cache // self.block_size
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], num_cached_blocks, num_full_blocks
        )
        self.num_cached_blocks[request_id] = max(num_cached_blocks, num_full_blocks)


def skips_prefix_cache(request: Request) -> bool:
    """Prompt logprobs and mean pooling need every prompt position computed: no cache reads
    (writes are fine)."""
    params = request.sampling_params
    return params.prompt_logprobs is not None or params.pooling == "mean"
