"""KVCacheManager: block tables across steps, refusals without side effects, frees, leaks."""

from __future__ import annotations

import random

import pytest

from tokenbus.core.kv import KVBlock, KVCacheManager, make_block_hasher
from tokenbus.core.request import Request
from tokenbus.sampling_params import SamplingParams

BLOCK_SIZE = 4


def ids(blocks: list[KVBlock] | None) -> list[int]:
    assert blocks is not None
    return [block.block_id for block in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def ref_cnts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def make_request(request_id: str, num_tokens: int, start: int = 0) -> Request:
    return Request(
        request_id,
        list(range(start, start + num_tokens)),
        SamplingParams(),
        block_hasher=make_block_hasher(BLOCK_SIZE),
    )


def decode_step(manager: KVCacheManager, request: Request, token_id: int = 7) -> list[int]:
    """One decode step as the scheduler and worker see it: 1 slot, then 1 new token."""
    new_blocks = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    request.append_output_token_ids(token_id)
    return ids(new_blocks)


def test_allocation_grows_one_block_at_a_time_with_decode_tokens() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("r", 10)
    assert manager.get_computed_blocks(request) == ([], 0)
    assert ids(manager.allocate_slots(request, 10)) == [1, 2, 3]  # cdiv(10, 4)
    request.num_computed_tokens = 10
    request.append_output_token_ids(100)  # 11 tokens: the sampled one has no KV yet
    blocks = manager.req_to_blocks["r"]
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert decode_step(manager, request) == []  # slot 10: block 3
    assert decode_step(manager, request) == []  # slot 11: block 3, now full
    assert blocks[2].block_hash == request.block_hashes[2]
    assert decode_step(manager, request) == [4]  # slot 12: a new block
    assert manager.get_block_ids("r") == [1, 2, 3, 4]
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(4 / 9)
    assert manager.num_cached_blocks["r"] == 3
    manager.check_consistency()
    manager.free(request)
    manager.check_integrity()


def test_chunked_prefill_caches_only_computed_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("r", 10)
    assert ids(manager.allocate_slots(request, 6)) == [1, 2]
    assert manager.num_cached_blocks["r"] == 1  # tokens 0..5: only block 1 is full
    request.num_computed_tokens = 6
    assert ids(manager.allocate_slots(request, 4)) == [3]
    assert manager.num_cached_blocks["r"] == 2
    assert manager.get_block_ids("r") == [1, 2, 3]
    manager.free(request)
    manager.check_integrity()


def test_draft_and_lookahead_tokens_get_slots_but_are_never_cached() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("r", 8)
    blocks = manager.allocate_slots(request, 8, num_lookahead_tokens=3)
    assert ids(blocks) == [1, 2, 3]  # cdiv(8 + 3, 4)
    request.num_computed_tokens = 8
    request.append_output_token_ids(50)  # 9 tokens
    request.spec_token_ids = [51, 52, 53]  # drafts to verify: slots 9..11 fill block 3
    num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens  # 1 + 3 drafts
    assert ids(manager.allocate_slots(request, num_new_tokens)) == []
    # Block 3 holds slots 8..11 (all computed this step), but only slot 8 is a real token.
    assert manager.req_to_blocks["r"][2].block_hash is None
    assert manager.num_cached_blocks["r"] == 2
    assert len(request.block_hashes) == 2  # drafts are not hashed either
    manager.free(request)
    manager.check_integrity()


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks
    first, second = make_request("a", 12), make_request("b", 8, start=100)
    assert ids(manager.allocate_slots(first, 12)) == [1, 2, 3]
    assert manager.allocate_slots(second, 8) is None
    assert manager.get_block_ids("b") == [] and "b" not in manager.req_to_blocks
    assert free_ids(manager) == [4]
    assert ref_cnts(manager, [1, 2, 3, 4]) == [1, 1, 1, 0]
    assert len(manager.block_pool.cached_block_hash_to_block) == 3
    assert ids(manager.allocate_slots(second, 4)) == [4]  # a chunk that fits
    manager.check_consistency()
    manager.free(first)
    manager.free(second)
    manager.check_integrity()


def test_lookahead_counts_against_capacity() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)  # 2 usable blocks
    request = make_request("r", 8)
    assert manager.allocate_slots(request, 8, num_lookahead_tokens=1) is None
    assert ids(manager.allocate_slots(request, 8)) == [1, 2]
    manager.free(request)
    manager.check_integrity()


def test_free_without_caching_reuses_blocks_in_table_order() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=False)
    request = make_request("r", 12)
    assert ids(manager.allocate_slots(request, 12)) == [1, 2, 3]
    manager.free(request)
    # Freed tail first, each unhashed block prepended: 3, then 2, then 1 at the head.
    assert free_ids(manager) == [1, 2, 3, 4, 5]
    manager.check_integrity()


def test_free_with_caching_evicts_tail_first() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("r", 10)  # blocks 1, 2 full and cached; block 3 partial
    assert ids(manager.allocate_slots(request, 10)) == [1, 2, 3]
    manager.free(request)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 2, 1]
    assert manager.get_block_ids("r") == []
    assert "r" not in manager.num_cached_blocks
    manager.check_integrity()


def test_preempted_request_starts_again_from_an_empty_table() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    request = make_request("r", 6)
    manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    request.append_output_token_ids(9)
    assert decode_step(manager, request) == []  # slot 6
    assert decode_step(manager, request) == []  # slot 7
    assert decode_step(manager, request) == [3]  # slot 8
    manager.free(request)  # preemption: the scheduler resets the rest
    request.num_computed_tokens = 0
    assert free_ids(manager)[:3] == [1, 2, 3]
    assert ids(manager.allocate_slots(request, request.num_tokens)) == [1, 2, 3]  # 10 tokens
    manager.free(request)
    manager.check_integrity()


def test_zero_tokens_and_bad_arguments() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("r", 4)
    assert manager.allocate_slots(request, 0) == []
    with pytest.raises(ValueError, match=">= 0"):
        manager.allocate_slots(request, -1)
    manager.allocate_slots(request, 4)
    hit = manager.block_pool.blocks[1]
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(request, 1, 4, [hit])
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    manager.free(request)
    manager.free(request)  # freeing twice (finish after preemption) is harmless
    manager.check_integrity()


def test_check_integrity_reports_leaks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("leaky", 4)
    manager.allocate_slots(request, 4)
    with pytest.raises(AssertionError, match="requests still hold KV blocks: \\['leaky'\\]"):
        manager.check_integrity()
    del manager.req_to_blocks["leaky"]  # forgotten without a free: block 1 leaks
    with pytest.raises(AssertionError, match="block 1 has ref_cnt 1 but 0 block-table entries"):
        manager.check_integrity()


def test_random_workload_keeps_ref_counts_consistent() -> None:
    """Many requests with shared prefixes, chunked prefill, decodes, preemptions and aborts."""
    rng = random.Random(0)
    manager = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    running: list[Request] = []
    for step in range(400):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            running.append(
                Request(
                    f"r{step}", prompt, SamplingParams(), block_hasher=make_block_hasher(BLOCK_SIZE)
                )
            )
        for request in list(running):
            _step_request(manager, request, running, rng)
        manager.check_consistency()
    for request in running:
        manager.free(request)
    manager.check_integrity()


def _step_request(
    manager: KVCacheManager, request: Request, running: list[Request], rng: random.Random
) -> None:
    num_hit_tokens, hit_blocks = 0, []
    if request.num_computed_tokens == 0 and not manager.get_block_ids(request.request_id):
        hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_remaining = request.num_tokens - request.num_computed_tokens - num_hit_tokens
    num_new_tokens = min(num_remaining, rng.randrange(1, 9))
    blocks = manager.allocate_slots(
        request,
        num_new_tokens,
        num_hit_tokens,
        hit_blocks,
        num_lookahead_tokens=rng.choice([0, 0, 2]),
    )
    if blocks is None or rng.random() < 0.05:  # preempted (no room) or aborted
        manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if rng.random() < 0.5:
            running.remove(request)
        return
    request.num_computed_tokens += num_hit_tokens + num_new_tokens
    if request.num_computed_tokens == request.num_tokens:
        request.append_output_token_ids(rng.randrange(50))
        if request.num_output_tokens >= 12:
            manager.free(request)
            running.remove(request)
