"""Which data-parallel engine gets a new request (L4): the decision alone, no I/O.

`DPLBClient` (dp_client.py) hands a router the prompt's chained block hashes (core/kv/
block_hash.py, computed as each engine computes them) and every engine's load, and sends the
request where `choose` says. Three policies (`--data-parallel-routing`):

- ``least_loaded``: the lowest `EngineLoad` (ties: the lower index).
- ``round_robin``: engines in turn, whatever their load.
- ``prefix`` (the default): the engine that holds the longest leading run of the prompt's
  block hashes, at least one full block more than the least loaded engine holds, as long as its
  load exceeds the least load by no more than the slack times that gain (the share of the
  prompt's full blocks it holds beyond the least loaded); otherwise the least loaded. A prefix
  that several requests were sent with has no slack. Ties: lower load, then lower index.

What an engine holds is a guess. The router remembers, per engine, the hashes of the prompts it
sent there, as an LRU bounded by that engine's KV blocks (it cannot cache more). Engines evict
on their own, under memory pressure, and the router never hears of it: a remembered prefix may
be gone, and the request then recomputes it as it would have anywhere else, at a load within
the slack. A request's hashes are remembered last block first, so that the record forgets a
prompt's tail before its head, in the order the engine's free queue evicts. Output tokens are
not remembered: the next turn of a chat matches on its prompt part.

The slack is the larger of `PREFIX_SLACK` and `PREFIX_SLACK_RATIO` × the least load. A load
unit is one request in flight, and a request waiting in an engine's queue weighs
`WAITING_WEIGHT` more (dp_client.py), so 4 units is one more queued request, or four more
running ones. A hit saves the prefill of the blocks it covers; a longer queue costs the prefills
ahead. So a hit on the whole prompt may cost about one queued request's wait, which a long
prompt's prefill repays, and a hit on a part of it that share: the next turn of a chat (most of
its prompt) stays where the chat went, a new chat that shares only a short system prompt
merely breaks a tie, so that concurrent new chats spread over the engines instead of piling on
the first one to see that prompt. The ratio keeps affinity alive under heavy load, where loads
jitter by more than 4 from step to step, and still bounds the imbalance to a quarter.

A long prefix that many requests share (a system prompt of a thousand tokens before short
questions, a document many ask about) would make a hot spot: held by one engine only, it would
draw every request there while the load difference stays within the slack, which at a steady
concurrency of up to 4 is forever, leaving the other engine idle. So the router counts, per
engine and block, the requests sent with it, and a match whose last block was sent more than
once is shared and has no slack: the first time another engine is lighter, that engine gets
the request, computes the prefix once, and from then on both hold it and equal matches go to
the lower load. A chat's history is private: the last block of its previous turn's prompt was
sent with that turn only, so the slack holds the chat where it went.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

PREFIX_SLACK = 4.0
PREFIX_SLACK_RATIO = 0.25


class EngineLoad(NamedTuple):
    """How busy an engine is; compared as a tuple (requests, then KV usage)."""

    requests: float  # in flight there + WAITING_WEIGHT × its reported waiting queue
    kv_usage: float = 0.0  # fraction of its KV blocks in use


class Router(Protocol):
    def choose(self, block_hashes: Sequence[bytes], loads: Sequence[EngineLoad]) -> int:
        """The engine for a request whose prompt has these full-block hashes."""
        ...

    def forget(self, engine: int) -> None:
        """The engine's prefix cache was emptied (reset_prefix_cache)."""
        ...


def least_loaded(loads: Sequence[EngineLoad]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))


class LeastLoadedRouter:
    def choose(self, block_hashes: Sequence[bytes], loads: Sequence[EngineLoad]) -> int:
        return least_loaded(loads)

    def forget(self, engine: int) -> None:
        pass


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, block_hashes: Sequence[bytes], loads: Sequence[EngineLoad]) -> int:
        index = self._next % len(loads)
        self._next = index + 1
        return index

    def forget(self, engine: int) -> None:
        pass


class PrefixRouter:
    """The longest remembered prefix whose gain pays for its engine's excess load (module
    docstring; a shared prefix's gain pays for none), else the least loaded."""

    def __init__(
        self,
        capacities: Sequence[int],
        slack: float = PREFIX_SLACK,
        slack_ratio: float = PREFIX_SLACK_RATIO,
    ) -> None:
        if any(capacity < 1 for capacity in capacities):
            raise ValueError(f"every engine must remember at least one block, got {capacities}")
        self.capacities = list(capacities)
        self.slack = slack
        self.slack_ratio = slack_ratio
        # Per engine: hash → how many requests were sent there with that block, least recently
        # sent first.
        self._records: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in capacities]

    def choose(self, block_hashes: Sequence[bytes], loads: Sequence[EngineLoad]) -> int:
        if len(loads) != len(self._records):
            raise ValueError(f"{len(loads)} loads for {len(self._records)} engines")
        fallback = least_loaded(loads)
        floor = loads[fallback].requests
        slack = max(self.slack, self.slack_ratio * floor)
        matched = [self.matched_blocks(i, block_hashes) for i in range(len(loads))]
        num_blocks = max(len(block_hashes), 1)

        def within(i: int) -> bool:  # the fallback always is: no excess for no gain
            shared = matched[i] > 0 and self._records[i][block_hashes[matched[i] - 1]] > 1
            gain = (matched[i] - matched[fallback]) / num_blocks
            return loads[i].requests - floor <= (0.0 if shared else slack) * gain

        index = min(
            (i for i in range(len(loads)) if within(i)),
            key=lambda i: (-matched[i], loads[i], i),
        )
        self._remember(index, block_hashes)
        return index

    def matched_blocks(self, engine: int, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the prompt were sent to `engine` and not yet forgotten."""
        record = self._records[engine]
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in record:
                break  # hashes are chained: block i names blocks 0..i, as the engine looks up
            matched += 1
        return matched

    def num_remembered(self, engine: int) -> int:
        return len(self._records[engine])

    def times_sent(self, engine: int, block_hash: bytes) -> int:
        """How many requests were sent to `engine` with this block (0: forgotten or never)."""
        return self._records[engine].get(block_hash, 0)

    def forget(self, engine: int) -> None:
        self._records[engine].clear()

    def _remember(self, engine: int, block_hashes: Sequence[bytes]) -> None:
        record = self._records[engine]
        for block_hash in reversed(block_hashes):  # the head most recent: the tail goes first
            record[block_hash] = record.get(block_hash, 0) + 1
            record.move_to_end(block_hash)
        while len(record) > self.capacities[engine]:
            record.popitem(last=False)


def make_router(routing: str, capacities: Sequence[int]) -> Router:
    """The router for `ParallelConfig.data_parallel_routing`, engines holding `capacities`
    KV blocks each."""
    if routing == "prefix":
        return PrefixRouter(capacities)
    if routing == "least_loaded":
        return LeastLoadedRouter()
    if routing == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"unknown data_parallel_routing {routing!r}")
