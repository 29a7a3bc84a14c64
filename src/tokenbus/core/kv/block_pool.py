"""The pool of KV blocks: allocation, reference counts and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tokenbus.core.kv.block import KVBlock
from tokenbus.core.kv.free_queue import FreeBlockQueue

if TYPE_CHECKING:
    from tokenbus.core.request import Request


class BlockPool:
    """Every KV block, created once; free ones in a queue, cached ones findable by hash.

    Invariants (checked by ``check_integrity``):

    - block 0 is the null block: out of the queue forever, its ref count never changes;
    - any other block is in the free queue exactly when its ``ref_cnt`` is 0;
    - ``block.block_hash == h`` ⇔ ``block`` is in ``cached_block_hash_to_block[h]``. Free blocks
      keep their hash (a later request may still hit them); the hash is dropped lazily, when
      ``get_new_blocks`` pops the block for reuse;
    - free queue order = eviction order: unhashed blocks at the head (reused first), then hashed
      blocks least recently freed first (LRU).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks must be >= 1 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One hash may map to several blocks: identical blocks computed by concurrent requests
        # are not merged (block tables are append-only). block_id → block keeps insertion order.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks that requests hold, in [0, 1]."""
        num_usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / num_usable if num_usable else 0.0

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """A block holding ``block_hash``'s KV (in use or free), or None on a miss."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.num_free_blocks} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            self.evict_cached_hash(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 return to the queue in order.

        Unhashed blocks are prepended (nothing to keep: reused first), hashed blocks appended
        (evicted last, in the order given). Pass a request's blocks tail first, so that its
        later blocks are evicted before the prefix they chain from.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_block_queue.prepend(block)
            else:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (now full) under their hashes.

        ``blocks`` is the request's block table; block i holds tokens
        [i * block_size, (i + 1) * block_size) and its hash is ``request.block_hashes[i]``.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hashes but "
                f"{num_full_blocks} full blocks: create it with "
                "block_hasher=make_block_hasher(block_size) of the KV manager's block size"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = request.block_hashes[i]
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds a block."""
        num_used_blocks = self.num_blocks - 1 - self.num_free_blocks
        if num_used_blocks > 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_consistency(self) -> None:
        """Raise AssertionError unless the invariants in the class docstring hold (O(blocks))."""
        null = self.null_block
        require(
            null is self.blocks[0] and null.is_null and null.prev_free is None,
            "block 0 must be the null block, never free",
        )
        free_ids: set[int] = set()
        for block in self.free_block_queue.get_all_free_blocks():
            require(
                block.block_id not in free_ids, f"block {block.block_id} is twice in the free queue"
            )
            require(block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
            free_ids.add(block.block_id)
        require(
            len(free_ids) == self.num_free_blocks,
            f"free queue holds {len(free_ids)} blocks but counts {self.num_free_blocks}",
        )
        for block in self.blocks[1:]:
            require(
                block.block_id in free_ids or block.ref_cnt > 0,
                f"block {block.block_id} has ref_cnt 0 but is not in the free queue (leaked)",
            )
        num_mapped = 0
        for block_hash, same_hash in self.cached_block_hash_to_block.items():
            for block_id, block in same_hash.items():
                require(
                    block is self.blocks[block_id] and block.block_hash == block_hash,
                    f"hash map entry of block {block_id} does not match the block's hash",
                )
                num_mapped += 1
        num_hashed = sum(block.block_hash is not None for block in self.blocks)
        require(
            num_mapped == num_hashed,
            f"{num_hashed} blocks carry a hash but the hash map holds {num_mapped}",
        )

    def evict_cached_hash(self, block: KVBlock) -> None:
        """Drop ``block`` from the hash map before its KV is overwritten."""
        if block.block_hash is None:
            return
        same_hash = self.cached_block_hash_to_block[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None


def require(condition: bool, message: str) -> None:
    """An assert that ``python -O`` keeps."""
    if not condition:
        raise AssertionError(message)
