"""FreeBlockQueue and BlockPool: exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import pytest

from tokenbus.core.kv import BlockPool, FreeBlockQueue, KVBlock, make_block_hasher
from tokenbus.core.request import Request
from tokenbus.sampling_params import SamplingParams

BLOCK_SIZE = 4


def ids(blocks: list[KVBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def queue_ids(queue: FreeBlockQueue) -> list[int]:
    return ids(queue.get_all_free_blocks())


def pool_free_ids(pool: BlockPool) -> list[int]:
    return queue_ids(pool.free_block_queue)


def make_queue(num_blocks: int) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
    return FreeBlockQueue(blocks), blocks


def make_request(request_id: str, num_tokens: int, start: int = 0) -> Request:
    return Request(
        request_id,
        list(range(start, start + num_tokens)),
        SamplingParams(),
        block_hasher=make_block_hasher(BLOCK_SIZE),
    )


# --- FreeBlockQueue -------------------------------------------------------------------------


def test_queue_initialization_links_blocks_in_order() -> None:
    queue, blocks = make_queue(4)
    assert queue.num_free_blocks == len(queue) == 4
    assert queue_ids(queue) == [0, 1, 2, 3]
    # Real blocks are inner nodes between the two sentinels (block_id -1).
    assert blocks[0].prev_free is not None and blocks[0].prev_free.block_id == -1
    assert blocks[0].next_free is blocks[1]
    assert blocks[2].prev_free is blocks[1] and blocks[2].next_free is blocks[3]
    assert blocks[3].next_free is not None and blocks[3].next_free.block_id == -1


def test_queue_empty() -> None:
    queue = FreeBlockQueue()
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert queue.popleft_n(0) == []


def test_queue_popleft_unlinks_block() -> None:
    queue, blocks = make_queue(3)
    block = queue.popleft()
    assert block is blocks[0]
    assert block.prev_free is None and block.next_free is None
    assert queue_ids(queue) == [1, 2]
    assert queue.num_free_blocks == 2
    assert ids([queue.popleft(), queue.popleft()]) == [1, 2]
    with pytest.raises(ValueError):
        queue.popleft()


def test_queue_popleft_n() -> None:
    queue, blocks = make_queue(5)
    assert ids(queue.popleft_n(3)) == [0, 1, 2]
    assert queue_ids(queue) == [3, 4]
    with pytest.raises(ValueError, match="asked for 3 blocks, only 2"):
        queue.popleft_n(3)
    assert queue_ids(queue) == [3, 4]  # a refused popleft_n changes nothing
    assert ids(queue.popleft_n(2)) == [3, 4]
    assert queue.num_free_blocks == 0


def test_queue_append_and_append_n() -> None:
    queue, blocks = make_queue(4)
    popped = queue.popleft_n(3)
    queue.append(popped[1])
    assert queue_ids(queue) == [3, 1]
    queue.append_n([popped[2], popped[0]])
    assert queue_ids(queue) == [3, 1, 2, 0]
    assert queue.num_free_blocks == 4


def test_queue_prepend_puts_block_first() -> None:
    queue, blocks = make_queue(4)
    first, second = queue.popleft_n(2)
    queue.prepend(second)
    queue.prepend(first)
    assert queue_ids(queue) == [0, 1, 2, 3]
    assert queue.popleft() is first


def test_queue_remove_from_middle_and_ends() -> None:
    queue, blocks = make_queue(5)
    queue.remove(blocks[2])  # middle
    assert queue_ids(queue) == [0, 1, 3, 4]
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert queue_ids(queue) == [1, 3]
    assert queue.num_free_blocks == 2
    queue.remove(blocks[1])
    queue.remove(blocks[3])
    assert queue_ids(queue) == [] and queue.num_free_blocks == 0
    queue.append(blocks[2])  # an emptied queue still works
    assert queue_ids(queue) == [2]


def test_queue_rejects_double_insert_and_removing_absent_block() -> None:
    queue, blocks = make_queue(3)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    block = queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)
    assert queue_ids(queue) == [1, 2]


def test_block_repr_does_not_follow_links() -> None:
    queue, blocks = make_queue(1000)
    assert repr(blocks[500]) == "KVBlock(block_id=500, ref_cnt=0, block_hash=None, is_null=False)"
    assert blocks[1] != KVBlock(block_id=1)  # identity equality: no walk down the list


# --- BlockPool ------------------------------------------------------------------------------


def test_pool_initialization_reserves_null_block() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.num_free_blocks == 9
    assert pool_free_ids(pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert pool.usage == 0.0
    pool.check_consistency()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, enable_caching=True)
    assert BlockPool(num_blocks=1, enable_caching=True).usage == 0.0


def test_pool_get_new_blocks() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool_free_ids(pool) == [4, 5, 6, 7, 8, 9]
    assert pool.usage == pytest.approx(3 / 9)
    with pytest.raises(ValueError, match="only 6 are free"):
        pool.get_new_blocks(7)
    assert pool.num_free_blocks == 6
    pool.check_consistency()


def test_pool_free_unhashed_blocks_are_prepended_in_order_given() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.free_blocks(reversed(blocks))  # tail first: 3, 2, 1 each go to the head
    assert pool_free_ids(pool) == [1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)  # head first: 1, 2, 3 each go to the head
    assert pool_free_ids(pool) == [3, 2, 1, 4, 5]
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    pool.check_consistency()


def test_pool_free_hashed_blocks_are_appended() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    request = make_request("r", 10)  # 2 full blocks of 4, 2 tokens in a third
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=2)
    assert [b.block_hash for b in blocks] == [*request.block_hashes, None]
    pool.free_blocks(reversed(blocks))
    # 3 (unhashed) is reused first; 2 then 1 are evicted last, tail block first.
    assert pool_free_ids(pool) == [3, 4, 5, 2, 1]
    # Free blocks stay cache hits until reused.
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.check_consistency()


def test_pool_touch_takes_free_block_out_of_the_middle() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(2)  # [1, 2]
    pool.touch([blocks[0]])  # in use: ref count only
    assert blocks[0].ref_cnt == 2
    assert pool_free_ids(pool) == [3, 4, 5]
    pool.touch([pool.blocks[4]])  # free: leaves the queue
    assert pool.blocks[4].ref_cnt == 1
    assert pool_free_ids(pool) == [3, 5]
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool_free_ids(pool) == [3, 5]
    pool.free_blocks([blocks[0], blocks[1], pool.blocks[4]])
    assert pool_free_ids(pool) == [4, 2, 1, 3, 5]
    pool.check_consistency()


def test_pool_null_block_is_never_counted_or_freed() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert pool_free_ids(pool) == [1, 2, 3]
    pool.check_consistency()


def test_pool_free_more_than_taken_raises() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([block])


def test_pool_reuse_evicts_cached_hash_lazily() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)  # usable blocks: 1, 2
    request = make_request("r", 8)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool_free_ids(pool) == [2, 1]
    assert len(pool.cached_block_hash_to_block) == 2
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 2 and reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.check_consistency()


def test_pool_one_hash_may_map_to_several_blocks() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    first, second = make_request("a", 4), make_request("b", 4)  # same tokens, same hash
    assert first.block_hashes == second.block_hashes
    block_a, block_b = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [block_a], 0, 1)
    pool.cache_full_blocks(second, [block_b], 0, 1)
    (block_hash,) = first.block_hashes
    assert list(pool.cached_block_hash_to_block[block_hash]) == [1, 2]
    assert pool.get_cached_block(block_hash) is block_a
    pool.free_blocks([block_a, block_b])
    assert pool_free_ids(pool) == [3, 1, 2]
    pool.get_new_blocks(2)  # reuses 3 and 1: block 2 still holds the hash
    assert pool.get_cached_block(block_hash) is block_b
    pool.check_consistency()


def test_pool_cache_full_blocks_needs_the_hashes() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    request = Request("no-hasher", list(range(8)), SamplingParams())
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="make_block_hasher"):
        pool.cache_full_blocks(request, blocks, 0, 2)


def test_pool_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    request = make_request("r", 8)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in blocks)


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    request = make_request("r", 4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert not pool.reset_prefix_cache()  # block 1 is in use
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_consistency()


def test_pool_check_consistency_reports_corruption() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # leaked: nobody holds it, yet it is not free
    with pytest.raises(AssertionError, match="block 1 has ref_cnt 0 but is not in the free queue"):
        pool.check_consistency()
    block.ref_cnt = 1
    pool.blocks[2].block_hash = b"x" * 32  # a hash missing from the map
    with pytest.raises(AssertionError, match="hash map holds 0"):
        pool.check_consistency()
