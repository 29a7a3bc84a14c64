"""Data-parallel routing decisions (engine/dp_router.py): exact outcomes, no engines."""

from __future__ import annotations

import pytest

from tokenbus.config import ParallelConfig
from tokenbus.core.kv import make_block_hasher
from tokenbus.core.request import Request
from tokenbus.engine.dp_client import engine_loads
from tokenbus.engine.dp_router import (
    EngineLoad,
    LeastLoadedRouter,
    PrefixRouter,
    RoundRobinRouter,
    make_router,
)
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import SchedulerStats
from tokenbus.sampling_params import SamplingParams

BLOCK = 4


def hashes(tokens: list[int], cache_salt: str | None = None) -> list[bytes]:
    """The prompt's full-block hashes, as an engine computes them."""
    request = Request("r", tokens, SamplingParams(), cache_salt=cache_salt)
    return make_block_hasher(BLOCK)(request)


def idle(n: int = 2) -> list[EngineLoad]:
    return [EngineLoad(0)] * n


def loads(*requests: float) -> list[EngineLoad]:
    return [EngineLoad(r) for r in requests]


PROMPT = list(range(100, 124))  # six full blocks
OTHER = list(range(500, 524))


def test_engine_loads_weigh_the_waiting_queue_and_keep_kv_usage():
    assert engine_loads([0, 2], [None, SchedulerStats(num_waiting_reqs=1, kv_cache_usage=0.5)]) == [
        EngineLoad(0, 0.0),
        EngineLoad(5, 0.5),
    ]


def test_least_loaded_scores_then_kv_usage_then_index():
    router = LeastLoadedRouter()
    assert router.choose([], idle()) == 0
    assert router.choose([], loads(3, 1)) == 1
    # Fewer routed to engine 0, but its waiting queue weighs.
    stats = [SchedulerStats(num_waiting_reqs=2), SchedulerStats()]
    assert router.choose([], engine_loads([2, 4], stats)) == 1
    assert router.choose([], [EngineLoad(1, 0.5), EngineLoad(1, 0.1)]) == 1
    assert router.choose(hashes(PROMPT), loads(2, 2, 1)) == 2


def test_round_robin_ignores_load_and_prefix():
    router = RoundRobinRouter()
    assert [router.choose(hashes(PROMPT), loads(0, 9, 0)) for _ in range(7)] == [
        0, 1, 2, 0, 1, 2, 0,
    ]  # fmt: skip


def test_prefix_goes_back_to_the_engine_it_was_sent_to():
    router = PrefixRouter([100, 100])
    assert router.choose(hashes(PROMPT), loads(2, 1)) == 1  # no match yet: least loaded
    assert router.choose(hashes(PROMPT + [7, 8, 9, 10, 11]), loads(1, 3)) == 1  # the next turn
    assert router.choose(hashes(PROMPT), loads(1, 1)) == 1  # the tie would have said 0
    third = PROMPT + [7, 8, 9, 10, 11] + [12, 13, 14, 15, 16, 17, 18]  # a chat's history: private
    assert router.choose(hashes(third), loads(1, 3)) == 1
    assert router.choose(hashes(OTHER), loads(1, 2)) == 0  # an unrelated prompt: least loaded
    assert router.choose(hashes([1, 2, 3, 4] + PROMPT), loads(1, 2)) == 0  # matches lead
    assert [router.matched_blocks(e, hashes(PROMPT)) for e in (0, 1)] == [0, 6]


def test_prefix_prefers_the_longest_match_then_the_lower_load():
    def placed() -> PrefixRouter:
        """Two blocks of PROMPT on engines 0 and 2, four on engine 1 (loads past the slack)."""
        router = PrefixRouter([100, 100, 100])
        assert router.choose(hashes(PROMPT[:8]), loads(1, 9, 9)) == 0
        assert router.choose(hashes(PROMPT[:16]), loads(9, 1, 9)) == 1
        assert router.choose(hashes(PROMPT[:8]), loads(9, 9, 1)) == 2
        return router

    # Engine 1's gain over the least loaded: 2 of 6 blocks, worth 4 × 2/6 of excess load.
    assert placed().choose(hashes(PROMPT), loads(1, 2.5, 1)) == 0
    router = placed()
    assert router.choose(hashes(PROMPT), loads(1, 2, 1)) == 1
    # Equal matches: the lower load, then the lower index.
    assert router.choose(hashes(PROMPT[:8] + OTHER), loads(3, 1, 2)) == 1
    assert router.choose(hashes(PROMPT[:4] + OTHER[:4]), loads(2, 2, 2)) == 0


def test_prefix_match_under_one_block_is_no_match():
    router = PrefixRouter([100, 100])
    assert router.choose(hashes(PROMPT[:3]), loads(1, 2)) == 0
    assert router.num_remembered(0) == 0  # no full block: nothing to remember
    assert router.choose(hashes(PROMPT[:4]), loads(1, 2)) == 0
    assert router.choose(hashes(PROMPT[:4] + [1]), loads(2, 1)) == 0  # one block: worth 4
    assert router.choose(hashes(PROMPT[:3] + [1, 2]), loads(2, 1)) == 1  # first block differs


def test_prefix_load_slack_is_four_or_a_quarter_of_the_least_load_for_a_whole_hit():
    def held() -> PrefixRouter:
        router = PrefixRouter([100, 100])
        assert router.choose(hashes(PROMPT), loads(2, 1)) == 1
        return router

    router = held()
    assert router.choose(hashes(PROMPT), loads(1, 5)) == 1  # 4 above: still within
    assert router.choose(hashes(PROMPT), loads(1, 5.5)) == 0  # past it: the least loaded …
    assert router.choose(hashes(PROMPT), loads(1, 5.5)) == 0  # … which now holds it too
    assert router.choose(hashes(PROMPT), loads(4, 1)) == 1  # both hold it: the lower load
    assert held().choose(hashes(PROMPT), loads(20, 25)) == 1  # 20 / 4
    assert held().choose(hashes(PROMPT), loads(20, 25.5)) == 0
    # Only requests count against the slack; KV usage only breaks ties.
    assert held().choose(hashes(PROMPT), [EngineLoad(1, 0.0), EngineLoad(5, 0.99)]) == 1


def test_prefix_slack_shrinks_with_the_share_of_the_prompt_held():
    def held() -> PrefixRouter:
        router = PrefixRouter([100, 100])
        assert router.choose(hashes(PROMPT), loads(2, 1)) == 1  # six blocks on engine 1
        return router

    turn = PROMPT + OTHER[:8]  # the next turn: 6 of its 8 blocks held, worth 3 units
    assert held().choose(hashes(turn), loads(1, 4.5)) == 0
    assert held().choose(hashes(turn), loads(1, 4)) == 1

    def shared() -> PrefixRouter:
        router = held()
        assert router.choose(hashes(PROMPT[:4]), loads(1, 9)) == 0  # the first block too
        return router

    # Held by both, the shared head is no gain: one more block of eight is worth 4 / 8.
    longer = PROMPT[:8] + OTHER[:24]
    assert shared().choose(hashes(longer), loads(1, 1.6)) == 0
    assert shared().choose(hashes(longer), loads(1, 1.5)) == 1


def test_prefix_a_shared_prefix_has_no_slack():
    system = list(range(900, 940))  # ten blocks
    questions = [hashes(system + [q, q + 1, q + 2, q + 3]) for q in range(0, 24, 4)]
    router = PrefixRouter([100, 100])
    assert router.choose(questions[0], loads(0, 0)) == 0
    # Sent with one request, the system prompt is private: worth 4 × 10/11 of load.
    assert router.choose(questions[1], loads(1, 0)) == 0
    assert router.times_sent(0, questions[1][9]) == 2
    # Sent with two, it is shared: the lighter engine gets the next question and holds it too.
    assert router.choose(questions[2], loads(2, 0)) == 1
    assert router.times_sent(1, questions[2][9]) == 1
    # From then on the questions go by load (a steady concurrency of 2 here).
    other_running = [(0, 1), (1, 0), (1, 2)]
    assert [router.choose(q, loads(*o)) for q, o in zip(questions[3:], other_running)] == [0, 1, 0]


def test_prefix_spreads_new_chats_that_share_a_short_system_prompt():
    system = list(range(900, 908))  # two blocks
    chats = [system + [c * 100 + t for t in range(32)] for c in range(1, 5)]  # ten blocks each
    router = PrefixRouter([100, 100])
    # Sent while both engines are busy: engine 0's system prompt is worth 4 × 2/10 < 1.
    assert router.choose(hashes(chats[0]), loads(1, 1)) == 0
    assert router.choose(hashes(chats[1]), loads(2, 1)) == 1
    assert router.choose(hashes(chats[2]), loads(2, 2)) == 0
    assert router.choose(hashes(chats[3]), loads(3, 2)) == 1
    # Their next turns go back where each chat went, against the load.
    assert [router.choose(hashes(chat + [5, 6, 7, 8]), loads(3, 3)) for chat in chats] == [
        0, 1, 0, 1,
    ]  # fmt: skip
    assert router.choose(hashes(chats[1] + [5, 6, 7, 8]), loads(1, 4)) == 1


def test_prefix_falls_back_to_the_best_match_within_the_slack():
    router = PrefixRouter([100, 100, 100])
    assert router.choose(hashes(PROMPT), loads(2, 1, 2)) == 1  # all six blocks on engine 1
    assert router.choose(hashes(PROMPT[:8]), loads(9, 9, 1)) == 2  # two on engine 2
    # Engine 1 gains 6 of 6 blocks, 9 above the least load; engine 2 gains 2, 1 above.
    assert router.choose(hashes(PROMPT), loads(1, 10, 2)) == 2


def test_prefix_record_is_an_lru_bounded_by_the_engines_blocks_tail_first():
    router = PrefixRouter([4, 100])
    router.choose(hashes(PROMPT), idle())  # six blocks into room for four: the head stays
    assert router.num_remembered(0) == 4
    assert router.matched_blocks(0, hashes(PROMPT)) == 4
    router.choose(hashes(OTHER[:8]), idle())  # two more: the first prompt's tail goes first
    assert router.matched_blocks(0, hashes(PROMPT)) == 2
    assert router.matched_blocks(0, hashes(OTHER)) == 2
    assert router.choose(hashes(PROMPT[:8]), loads(0, 1)) == 0  # a hit refreshes its blocks
    router.choose(hashes(OTHER[:4] + [1, 2, 3, 4]), loads(0, 1))  # one new block on engine 0
    assert router.matched_blocks(0, hashes(PROMPT)) == 2
    assert router.matched_blocks(0, hashes(OTHER)) == 1  # OTHER's second block was oldest


def test_prefix_cache_salt_separates_tenants():
    router = PrefixRouter([100, 100])
    assert router.choose(hashes(PROMPT, cache_salt="a"), loads(2, 1)) == 1
    assert router.choose(hashes(PROMPT, cache_salt="b"), loads(1, 2)) == 0
    assert router.choose(hashes(PROMPT, cache_salt="a"), loads(1, 2)) == 1
    assert router.choose(hashes(PROMPT), loads(1, 2)) == 0


def test_prefix_forget_after_a_cache_reset():
    router = PrefixRouter([100, 100])
    assert router.choose(hashes(PROMPT), loads(2, 1)) == 1
    router.forget(1)
    assert router.num_remembered(1) == 0
    assert router.choose(hashes(PROMPT), idle()) == 0


def test_make_router_and_the_flag():
    assert isinstance(make_router("prefix", [8, 8]), PrefixRouter)
    assert isinstance(make_router("least_loaded", [8, 8]), LeastLoadedRouter)
    assert isinstance(make_router("round_robin", [8, 8]), RoundRobinRouter)
    assert EngineArgs().to_config(64).parallel.data_parallel_routing == "prefix"
    config = EngineArgs(data_parallel_routing="round_robin").to_config(64)
    assert config.parallel.data_parallel_routing == "round_robin"
    with pytest.raises(ValueError, match="data_parallel_routing must be one of"):
        ParallelConfig(data_parallel_routing="random")
    with pytest.raises(ValueError, match="at least one block"):
        PrefixRouter([8, 0])
    with pytest.raises(ValueError, match="3 loads for 2 engines"):
        PrefixRouter([8, 8]).choose([], idle(3))


def test_cli_flag_reaches_engine_args():
    import argparse

    from tokenbus.cli.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--data-parallel-routing", "least_loaded"])
    assert engine_args_from(ns).data_parallel_routing == "least_loaded"
    assert engine_args_from(parser.parse_args([])).data_parallel_routing == "prefix"
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-parallel-routing", "random"])
