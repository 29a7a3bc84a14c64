"""Automatic prefix caching: hits, eviction order, salts, sharing, preemption, reset, hashes."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tokenbus.core.kv import (
    NONE_HASH,
    KVBlock,
    KVCacheManager,
    block_extra_keys,
    hash_block_tokens,
    make_block_hasher,
)
from tokenbus.core.request import Request
from tokenbus.sampling_params import SamplingParams

BLOCK_SIZE = 16


def ids(blocks: list[KVBlock] | None) -> list[int]:
    assert blocks is not None
    return [block.block_id for block in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def ref_cnts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def tokens(start: int, num_tokens: int) -> list[int]:
    return list(range(start, start + num_tokens))


def make_request(
    request_id: str,
    prompt: list[int],
    cache_salt: str | None = None,
    sampling_params: object | None = None,
) -> Request:
    return Request(
        request_id,
        prompt,
        sampling_params or SamplingParams(),
        cache_salt=cache_salt,
        block_hasher=make_block_hasher(BLOCK_SIZE),
    )


def admit(manager: KVCacheManager, request: Request) -> tuple[list[KVBlock] | None, int]:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit_blocks
    )
    return new_blocks, num_hit_tokens


def test_prefill_hit_shares_blocks_and_free_order_is_lru() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    common = tokens(0, 48)  # 3 full blocks
    first = make_request("0", common + tokens(1000, 7))  # 55 tokens
    blocks, num_hit_tokens = admit(manager, first)
    assert (ids(blocks), num_hit_tokens) == ([1, 2, 3, 4], 0)
    assert [b.block_hash for b in blocks] == [*first.block_hashes, None]
    assert len(manager.block_pool.cached_block_hash_to_block) == 3

    second = make_request("1", common + tokens(2000, 5))  # 53 tokens
    blocks, num_hit_tokens = admit(manager, second)
    assert (ids(blocks), num_hit_tokens) == ([1, 2, 3, 5], 48)
    assert ref_cnts(manager, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    manager.check_consistency()

    manager.free(first)  # 4 (partial) to the head; 1..3 still held by "1"
    assert free_ids(manager) == [4, 6, 7, 8, 9, 10]
    manager.free(second)  # 5 (partial) to the head; 3, 2, 1 appended tail first
    assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.check_integrity()

    # A 160-token request takes every block, in eviction order, evicting the old hashes.
    third = make_request("2", tokens(5000, 160))
    blocks, _ = admit(manager, third)
    assert ids(blocks) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert set(manager.block_pool.cached_block_hash_to_block) == set(third.block_hashes[:10])
    assert manager.get_computed_blocks(make_request("3", common + [1]))[1] == 0
    manager.free(third)
    manager.check_integrity()


def test_partial_hit_stops_at_first_miss() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    first = make_request("0", tokens(0, 48) + [1])
    admit(manager, first)
    # Same first two blocks, different third: the hit stops there, even though a later
    # block's tokens could match (hashes chain through the prefix).
    second = make_request("1", tokens(0, 32) + tokens(900, 16) + tokens(0, 16) + [1])
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert (ids(hit_blocks), num_hit_tokens) == ([1, 2], 32)
    blocks = manager.allocate_slots(second, second.num_tokens - 32, 32, hit_blocks)
    assert ids(blocks) == [1, 2, 5, 6, 7]
    manager.free(first)
    manager.free(second)
    manager.check_integrity()


def test_full_prompt_hit_recomputes_last_block() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    first = make_request("0", tokens(0, 32))
    assert ids(admit(manager, first)[0]) == [1, 2]
    # Fully cached 32-token prompt: the hit stops at token 31, so only one block hits.
    second = make_request("1", tokens(0, 32))
    blocks, num_hit_tokens = admit(manager, second)
    assert (ids(blocks), num_hit_tokens) == ([1, 3], 16)
    # Block 3 recomputes block 2's tokens: two blocks under one hash (no dedup).
    assert list(manager.block_pool.cached_block_hash_to_block[first.block_hashes[1]]) == [2, 3]
    # One more token and the whole cached prefix hits.
    third = make_request("2", tokens(0, 33))
    blocks, num_hit_tokens = admit(manager, third)
    assert (ids(blocks), num_hit_tokens) == ([1, 2, 4], 32)
    for request in (first, second, third):
        manager.free(request)
    manager.check_integrity()


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    first = make_request("0", tokens(0, 20))  # block 1 full (cached), block 2 partial
    admit(manager, first)
    manager.free(first)
    assert free_ids(manager) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1]
    other = make_request("1", tokens(500, 8))
    assert ids(admit(manager, other)[0]) == [2]
    assert manager.get_computed_blocks(make_request("2", tokens(0, 20)))[1] == 16
    manager.free(other)
    manager.check_integrity()


def test_eviction_is_lru_over_requests_and_tail_first_within_one() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    first, second = make_request("a", tokens(0, 32)), make_request("b", tokens(100, 32))
    assert ids(admit(manager, first)[0]) == [1, 2]
    assert ids(admit(manager, second)[0]) == [3, 4]
    manager.free(first)
    manager.free(second)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 2, 1, 4, 3]
    # 7 new blocks: the 6 never-cached ones, then "a"'s tail block.
    big = make_request("c", tokens(1000, 7 * 16 - 1))
    assert ids(admit(manager, big)[0]) == [5, 6, 7, 8, 9, 10, 2]
    # "a" keeps its first block, "b" both.
    assert manager.get_computed_blocks(make_request("a2", tokens(0, 33)))[1] == 16
    assert manager.get_computed_blocks(make_request("b2", tokens(100, 33)))[1] == 32
    manager.free(big)
    manager.check_integrity()


def test_cache_salt_isolates_tenants() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    prompt = tokens(0, 40)
    salted = make_request("x", prompt, cache_salt="tenant-x")
    unsalted = make_request("plain", prompt)
    # The salt enters the first block only, yet every hash differs through the chain.
    assert block_extra_keys(salted, 0) == (("salt", "tenant-x"),)
    assert block_extra_keys(salted, 1) is None and block_extra_keys(unsalted, 0) is None
    assert all(a != b for a, b in zip(salted.block_hashes, unsalted.block_hashes))
    admit(manager, salted)
    assert manager.get_computed_blocks(unsalted) == ([], 0)
    assert manager.get_computed_blocks(make_request("y", prompt, cache_salt="tenant-y"))[1] == 0
    assert manager.get_computed_blocks(make_request("x2", prompt, cache_salt="tenant-x"))[1] == 32
    manager.free(salted)
    manager.check_integrity()


def test_blocks_held_by_running_requests_are_never_evicted() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks
    running = make_request("a", tokens(0, 16) + [1])  # block 1 cached, block 2 partial
    assert ids(admit(manager, running)[0]) == [1, 2]
    other = make_request("b", tokens(100, 32))
    assert ids(admit(manager, other)[0]) == [3, 4]
    manager.free(other)
    assert free_ids(manager) == [4, 3]
    sharer = make_request("c", tokens(0, 16) + [2])  # shares block 1 with the running "a"
    blocks, num_hit_tokens = admit(manager, sharer)
    assert (ids(blocks), num_hit_tokens) == ([1, 4], 16)
    assert ref_cnts(manager, [1, 2, 3, 4]) == [2, 1, 0, 1]
    # The last free block goes to a newcomer; block 1 stays cached and shared.
    newcomer = make_request("d", tokens(500, 10))
    assert ids(admit(manager, newcomer)[0]) == [3]
    cached = manager.block_pool.get_cached_block(running.block_hashes[0])
    assert cached is manager.block_pool.blocks[1]
    assert admit(manager, make_request("e", tokens(700, 10))) == (None, 0)
    for request in (running, sharer, newcomer):
        manager.free(request)
    manager.check_integrity()


def test_hit_on_free_blocks_counts_against_capacity() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks
    first = make_request("a", tokens(0, 32))
    other = make_request("b", tokens(100, 16))
    assert ids(admit(manager, first)[0]) == [1, 2]
    assert ids(admit(manager, other)[0]) == [3]
    manager.free(first)
    assert free_ids(manager) == [4, 2, 1]
    # Hits 1 and 2 (both free) + 2 new blocks = 4 > 3 free blocks: refused, nothing changed.
    grower = make_request("c", tokens(0, 32) + tokens(900, 20))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(grower)
    assert (ids(hit_blocks), num_hit_tokens) == ([1, 2], 32)
    assert manager.allocate_slots(grower, 20, 32, hit_blocks) is None
    assert free_ids(manager) == [4, 2, 1]
    assert ref_cnts(manager, [1, 2]) == [0, 0]
    assert manager.block_pool.get_cached_block(first.block_hashes[1]) is hit_blocks[1]
    # Once "b" leaves it fits: the hits leave the queue from the middle and the tail.
    manager.free(other)
    assert free_ids(manager) == [4, 2, 1, 3]
    assert ids(manager.allocate_slots(grower, 20, 32, hit_blocks)) == [1, 2, 4, 3]
    assert free_ids(manager) == []
    assert ref_cnts(manager, [1, 2, 3, 4]) == [1, 1, 1, 1]
    manager.free(grower)
    manager.check_integrity()


def test_block_cached_this_step_is_hit_in_the_same_step() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    prompt = tokens(0, 40)
    first = make_request("a", prompt)
    assert ids(admit(manager, first)[0]) == [1, 2, 3]
    # Nothing has run yet ("a" has no computed tokens), but blocks 1 and 2 will be written
    # before any read of this step: the second request of the batch may already use them.
    second = make_request("b", prompt)
    blocks, num_hit_tokens = admit(manager, second)
    assert (ids(blocks), num_hit_tokens) == ([1, 2, 4], 32)
    # A first chunk caches only the blocks it fills.
    chunked = make_request("c", tokens(500, 40))
    assert ids(manager.allocate_slots(chunked, 20)) == [5, 6]
    assert manager.get_computed_blocks(make_request("d", tokens(500, 40)))[1] == 16
    for request in (first, second, chunked):
        manager.free(request)
    manager.check_integrity()


def test_parallel_samples_share_the_prompt_blocks() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    children = [make_request(f"p-{i}", tokens(0, 40)) for i in range(3)]  # n=3, one prompt
    table_ids = [ids(admit(manager, child)[0]) for child in children]
    assert table_ids == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert ref_cnts(manager, [1, 2, 3, 4, 5]) == [3, 3, 1, 1, 1]
    for i, child in enumerate(children):  # the samples diverge in their own partial blocks
        child.num_computed_tokens = 40
        child.append_output_token_ids(1000 + i)
        assert manager.allocate_slots(child, 1) == []
    for child in children:
        manager.free(child)
    assert free_ids(manager) == [5, 4, 3, 6, 7, 8, 9, 10, 2, 1]
    manager.check_integrity()


def test_preempted_request_rehits_its_own_blocks() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    request = make_request("a", tokens(0, 40))
    assert ids(admit(manager, request)[0]) == [1, 2, 3]
    request.num_computed_tokens = 40
    for token_id in range(10):  # decode to 50 tokens: block 3 fills, block 4 starts
        request.append_output_token_ids(token_id)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    assert manager.num_cached_blocks["a"] == 3
    manager.make_prefix_cache_stats()

    manager.free(request)  # preemption, as the scheduler does it
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    blocks, num_hit_tokens = admit(manager, request)
    assert (ids(blocks), num_hit_tokens) == ([1, 2, 3, 4], 48)  # 3 full blocks of 50 tokens
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.preempted_requests) == (0, 1)
    assert (stats.preempted_queries, stats.preempted_hits) == (50, 48)
    manager.free(request)
    manager.check_integrity()


def test_reset_prefix_cache_refused_while_in_use() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    request = make_request("a", tokens(0, 40))
    admit(manager, request)
    assert not manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", tokens(0, 40)))[1] == 32
    assert not manager.make_prefix_cache_stats().reset
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.make_prefix_cache_stats().reset
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request("c", tokens(0, 40))) == ([], 0)
    manager.check_integrity()


def test_prefix_cache_stats_per_interval_and_cumulative() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    first = make_request("a", tokens(0, 40))
    admit(manager, first)
    second = make_request("b", tokens(0, 40))
    admit(manager, second)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    assert stats.hit_rate == pytest.approx(0.4)
    assert manager.make_prefix_cache_stats().queries == 0  # a new interval
    manager.get_computed_blocks(make_request("c", tokens(0, 17)))
    total = manager.total_prefix_cache_stats
    assert (total.requests, total.queries, total.hits) == (3, 97, 48)
    manager.free(first)
    manager.free(second)
    manager.check_integrity()


def test_prompt_logprobs_skip_reading_but_still_write_the_cache() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    wants_logprobs = SimpleNamespace(prompt_logprobs=0)  # the field SamplingParams may grow
    first = make_request("a", tokens(0, 40), sampling_params=wants_logprobs)
    assert admit(manager, first) == (manager.block_pool.blocks[1:4], 0)
    again = make_request("b", tokens(0, 40), sampling_params=wants_logprobs)
    assert manager.get_computed_blocks(again) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", tokens(0, 40)))[1] == 32
    manager.free(first)
    manager.check_integrity()


def test_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, enable_caching=False)
    first = make_request("a", tokens(0, 40))
    assert ids(admit(manager, first)[0]) == [1, 2, 3]
    second = make_request("b", tokens(0, 40))
    assert admit(manager, second) == (manager.block_pool.blocks[4:7], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.total_prefix_cache_stats.requests == 0
    manager.free(first)
    manager.free(second)
    assert free_ids(manager) == [4, 5, 6, 1, 2, 3, 7, 8, 9, 10]  # most recently freed first
    manager.check_integrity()


# --- hashes ---------------------------------------------------------------------------------


def test_hash_block_tokens_covers_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2, 3])
    assert len(base) == 32
    assert base == hash_block_tokens(NONE_HASH, (1, 2, 3))  # None parent = NONE_HASH; any sequence
    assert base != hash_block_tokens(None, [3, 2, 1])
    assert base != hash_block_tokens(base, [1, 2, 3])
    assert base != hash_block_tokens(None, [1, 2, 3], ())
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))
    assert hash_block_tokens(None, [1], (True,)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    with pytest.raises(TypeError, match="cannot hash an extra key of type dict"):
        hash_block_tokens(None, [1], ({"a": 1},))
    with pytest.raises(ValueError, match="32 bytes"):
        hash_block_tokens(b"short", [1])


def test_block_hasher_is_incremental_and_ignores_drafts() -> None:
    request = make_request("a", tokens(0, 20))
    assert len(request.block_hashes) == 1
    request.spec_token_ids = tokens(100, 30)  # drafts are never hashed
    request.append_output_token_ids(tokens(20, 11))  # 31 tokens: still one full block
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(31)  # 32 tokens: the second block is full
    assert len(request.block_hashes) == 2
    from_scratch = make_request("b", tokens(0, 32))
    assert request.block_hashes == from_scratch.block_hashes
    assert from_scratch.block_hashes[1] == hash_block_tokens(
        hash_block_tokens(None, tokens(0, 16)), tokens(16, 16)
    )
    with pytest.raises(ValueError, match="block_size"):
        make_block_hasher(0)


HASH_SCRIPT = (
    "from tokenbus.core.kv import hash_block_tokens as h;"
    "print(h(h(None, range(16), (('salt', 'x'),)), [5, 2**40, 0]).hex())"
)
# Pinned: changing the byte encoding changes every hash (and invalidates any stored one).
GOLDEN_HASH = "22ea24ae054fe363010d533b9033a445190a73fc4ec7c06736b39196db3cdf12"


def test_hash_is_stable_across_processes_and_hash_seeds() -> None:
    in_process = hash_block_tokens(
        hash_block_tokens(None, range(16), (("salt", "x"),)), [5, 2**40, 0]
    ).hex()
    assert in_process == GOLDEN_HASH
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT], env=env, check=True, capture_output=True, text=True
        )
        assert out.stdout.strip() == in_process
