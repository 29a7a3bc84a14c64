"""HybridKVCacheManager: KV groups per window over one pool; a sliding group frees the blocks that
fell out of its window while the request runs; prefix hits need every group; preemption frees
every group; admission counts every group's blocks. Exact block ids, free-queue order, leaks."""

from __future__ import annotations

import pytest

from tokenbus.core.kv import make_block_hasher
from tokenbus.core.kv.hybrid import HybridKVCacheManager, KVGroup, plan_kv_groups
from tokenbus.core.request import Request
from tokenbus.sampling_params import SamplingParams

BS = 4
WINDOW = 8
NULL = 0


def manager(num_blocks: int = 20, caching: bool = True) -> HybridKVCacheManager:
    # layer 0 full, layer 1 windowed: group 0 full, group 1 sliding
    return HybridKVCacheManager(num_blocks, BS, plan_kv_groups([None, WINDOW]), caching)


def request(request_id: str, num_tokens: int, start: int = 100) -> Request:
    return Request(
        request_id,
        list(range(start, start + num_tokens)),
        SamplingParams(),
        block_hasher=make_block_hasher(BS),
    )


def ids(groups) -> list[list[int]]:
    assert groups is not None
    return [[block.block_id for block in blocks] for blocks in groups]


def free_ids(kv: HybridKVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def run(kv: HybridKVCacheManager, req: Request, num_new: int) -> list[list[int]]:
    """One step: slots for num_new tokens, computed, and (past the prompt) one sampled token."""
    added = ids(kv.allocate_slots(req, num_new))
    req.num_computed_tokens += num_new
    if req.num_computed_tokens >= req.num_tokens:
        req.append_output_token_ids(7)
    kv.check_consistency()
    return added


def test_groups_of_equal_size_per_window():
    gemma3 = ([1024] * 5 + [None]) * 2  # 5 local : 1 global
    layout = plan_kv_groups(gemma3)
    assert layout.groups == (
        KVGroup(1024, (0, 1)),
        KVGroup(1024, (2, 3)),
        KVGroup(1024, (4, 6)),
        KVGroup(1024, (7, 8)),
        KVGroup(1024, (9, 10)),
        KVGroup(None, (5, 11)),
    )
    assert layout.num_buffers == 2 and layout.place(6) == (2, 1) and layout.place(11) == (5, 1)
    assert plan_kv_groups(gemma3, hybrid=False).groups == (KVGroup(None, tuple(range(12))),)
    assert plan_kv_groups([None] * 3).groups == (KVGroup(None, (0, 1, 2)),)
    assert plan_kv_groups([16] * 2).groups == (KVGroup(16, (0, 1)),)  # Mistral: one group


def test_layers_reading_another_s_kv_join_no_group():
    """Gemma 3n's E2B pattern: the last layers read an earlier layer's K/V; they hold no buffer
    and are placed where their owner is."""
    windows = ([512] * 4 + [None]) * 3  # 15 layers; 10..14 read 8 (local) and 9 (global)
    shared = tuple((layer, 9 if windows[layer] is None else 8) for layer in range(10, 15))
    layout = plan_kv_groups(windows, shared=shared)
    assert layout.groups == (
        KVGroup(512, (0, 1)),
        KVGroup(512, (2, 3)),
        KVGroup(512, (5, 6)),
        KVGroup(512, (7, 8)),
        KVGroup(None, (4, 9)),
    )
    assert layout.num_buffers == 2
    assert [layout.place(layer) for layer in (8, 10, 13, 9, 14)] == [(3, 1)] * 3 + [(4, 1)] * 2
    one = plan_kv_groups([None] * 4, shared=((3, 2),))
    assert one.groups == (KVGroup(None, (0, 1, 2)),) and one.place(3) == (0, 2)


def test_layers_holding_no_kv_join_no_group():
    """LFM3's pattern: convolutions (recurrent, no K/V) between its global and sliding layers;
    they join no group, hold no buffer and have no place, but count among the layers."""
    windows = [None, None, None, None, 256, None, None, None, 256, None]
    convs = (0, 1, 3, 5, 7, 9)
    layout = plan_kv_groups(windows, stateless=convs)
    assert layout.groups == (KVGroup(None, (2, 6)), KVGroup(256, (4, 8)))
    assert layout.num_buffers == 2 and layout.num_layers == 10
    assert [layout.group_of(layer) for layer in range(4)] == [None, None, 0, None]
    assert layout.place(8) == (1, 1)
    with pytest.raises(ValueError, match="in no KV group"):
        layout.place(0)
    one = plan_kv_groups([None, 64, None], hybrid=False, stateless=(2,))
    assert one.groups == (KVGroup(None, (0, 1)),) and one.group_of(2) is None
    with pytest.raises(ValueError, match="at least one layer holding K/V"):
        plan_kv_groups([None, 64], stateless=(0, 1))


def test_sliding_group_frees_out_of_window_blocks():
    kv = manager()
    req = request("r", 10)
    assert run(kv, req, 10) == [[1, 2, 3], [4, 5, 6]]
    assert run(kv, req, 1) == [[], []]  # position 10: keys 3.. still in block 0
    assert run(kv, req, 1) == [[], []]
    # computed 12: the next query (12) sees keys 5..12: sliding block 0 (id 4) goes back, hashed,
    # to the queue's tail (still a prefix hit); both groups then take a block for tokens 12..15.
    assert run(kv, req, 1) == [[7], [8]]
    assert kv.get_all_block_ids("r") == [[1, 2, 3, 7], [NULL, 5, 6, 8]]
    assert free_ids(kv) == [*range(9, 20), 4]
    held = []
    for _ in range(30):
        run(kv, req, 1)
        held.append(kv.num_held_blocks(1))
    assert max(held) <= WINDOW // BS + 1  # bounded, while the full group grows
    assert kv.num_held_blocks(0) == 11
    table = kv.get_all_block_ids("r")[1]
    assert table[:8] == [NULL] * 8 and NULL not in table[8:]
    kv.free(req)
    kv.check_integrity()


def test_prefix_hit_needs_every_group():
    kv = manager()
    first = request("a", 20)
    run(kv, first, 20)
    kv.free(first)
    second = request("b", 25)
    hits, num_hit = kv.get_computed_blocks(second)
    # 5 full blocks; the sliding group needs only blocks 3 and 4 (keys 13.. of query 20)
    assert num_hit == 20
    assert ids(hits) == [[1, 2, 3, 4, 5], [NULL, NULL, NULL, 9, 10]]
    assert ids(kv.allocate_slots(second, 5, 20, hits)) == [
        [1, 2, 3, 4, 5, 11, 12],
        [NULL, NULL, NULL, 9, 10, 13, 14],
    ]
    kv.check_consistency()
    kv.free(second)
    # A missing sliding block in the window shortens the hit for every group...
    kv.evict_cached_blocks([10])
    hits, num_hit = kv.get_computed_blocks(request("c", 25))
    assert num_hit == 16 and ids(hits) == [[1, 2, 3, 4], [NULL, NULL, 8, 9]]
    # ...and so does a missing full-attention block, whatever the sliding group holds.
    kv.evict_cached_blocks([2])
    hits, num_hit = kv.get_computed_blocks(request("d", 25))
    assert num_hit == 4 and ids(hits) == [[1], [6]]
    kv.check_integrity()


def test_preemption_frees_every_group_and_hits_again():
    kv = manager(num_blocks=12)
    req = request("r", 16)
    run(kv, req, 16)
    for _ in range(4):
        run(kv, req, 1)
    # computed 19: query 19 sees keys 12..: sliding blocks 0-2 are back in the pool (hashed)
    assert kv.get_all_block_ids("r") == [[1, 2, 3, 4, 9], [NULL, NULL, NULL, 8, 10]]
    kv.free(req)  # preempted: everything back, tail first per group
    req.num_computed_tokens = 0
    assert kv.num_free_blocks == 11
    kv.check_integrity()
    hits, num_hit = kv.get_computed_blocks(req)  # its 21 tokens: 5 full blocks hit again
    assert num_hit == 20 and ids(hits) == [[1, 2, 3, 4, 9], [NULL, NULL, NULL, 8, 10]]
    kv.allocate_slots(req, 1, 20, hits)
    kv.check_consistency()
    kv.free(req)
    kv.check_integrity()


def test_admission_counts_every_group():
    kv = manager(num_blocks=6)  # 5 usable
    req = request("r", 12)
    assert kv.allocate_slots(req, 12) is None  # 3 + 3 blocks
    assert kv.num_free_blocks == 5 and not kv.holds_blocks("r")
    assert ids(kv.allocate_slots(req, 8)) == [[1, 2], [3, 4]]
    kv.check_consistency()
    kv.free(req)
    kv.check_integrity()


def test_disabled_hybrid_holds_every_block():
    kv = HybridKVCacheManager(40, BS, plan_kv_groups([None, WINDOW], hybrid=False))
    req = request("r", 10)
    run(kv, req, 10)
    for _ in range(30):
        run(kv, req, 1)
    assert kv.num_held_blocks() == 10  # slots for 40 tokens, none handed back
    kv.free(req)
    kv.check_integrity()


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding window"):
        HybridKVCacheManager(8, BS, plan_kv_groups([None, 0]))
