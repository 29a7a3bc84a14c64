"""Data parallelism: N EngineCore processes behind one client that routes requests (L4).

Each engine is a whole EngineCore with its own executor, KV cache and scheduler; the front end
(tokenizer, detokenizer, HTTP) stays one. The engines' reader threads all feed ONE
OutputChannel, each EngineOutputs tagged with its engine's index, so the front end reads a
single stream whatever N is.

Routing: a router (dp_router.py, `--data-parallel-routing`) picks the engine from the prompt's
block hashes and each engine's load,

    load = in-flight requests routed there + WAITING_WEIGHT × the engine's last reported
           waiting queue

(the in-flight count is exact and current; the waiting queue, reported each step, says where a
new request would queue behind others), ties broken by KV-cache usage, then by index. The
default sends a prompt where its prefix was sent before, unless that engine is far busier than
the least loaded (after vLLM's DPLBAsyncMPClient, with SGLang's cache-aware routing); the block
hashes are computed here as the engines compute them, so equal hashes mean the same KV. Aborts
go to the owning engine. If any engine dies, the client is dead: every waiter fails and /health
turns 503 (a dead engine's requests cannot move).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenbus.core.kv import make_block_hasher
from tokenbus.core.request import Request
from tokenbus.engine.core_client import EngineCoreClient, OutputChannel
from tokenbus.engine.dp_router import EngineLoad, Router, make_router
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.mp_client import AsyncMPClient, EngineConnection, MPClient, SyncMPClient
from tokenbus.protocol import EngineOutputs, EngineRequest, SchedulerStats

if TYPE_CHECKING:
    from tokenbus.engine.core_proc import EngineFactory
    from tokenbus.engine.setup import EngineSetup

WAITING_WEIGHT = 3


class DPLBClient(EngineCoreClient):
    """Both halves of the client interface: sync for LLMEngine, asyncio for AsyncLLM (the
    engines' sends never block, so the coroutines call the sync methods)."""

    def __init__(
        self,
        setup: EngineSetup,
        engine_factory: EngineFactory,
        *,
        asyncio_mode: bool,
        ready_timeout_s: float | None = None,
        after_spawn: Callable[[], None] | None = None,
    ) -> None:
        num_engines = setup.config.parallel.data_parallel_size
        self._outputs = OutputChannel()
        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        self.clients: list[MPClient] = []
        connections: list[EngineConnection] = []
        try:
            # Spawn every engine first, then wait: their models load at the same time.
            for index in range(num_engines):
                connections.append(
                    EngineConnection(
                        _for_engine(setup, index), engine_factory, self._outputs, index
                    )
                )
            if after_spawn is not None:
                after_spawn()
            for connection in connections:
                self.clients.append(
                    cls(setup, engine_factory, ready_timeout_s, connection=connection)
                )
        except BaseException:
            for connection in connections[len(self.clients) :]:
                connection.close()
            self.shutdown()
            raise
        self.num_kv_blocks = min(client.num_kv_blocks for client in self.clients)
        self._owner: dict[str, int] = {}  # request id → engine index, until it finishes
        self._in_flight = [0] * num_engines
        self._stats: list[SchedulerStats | None] = [None] * num_engines
        self.num_routed = [0] * num_engines  # requests sent to each engine, ever
        routing = setup.config.parallel.data_parallel_routing
        caching = setup.config.cache.enable_prefix_caching
        if routing == "prefix" and not caching:
            routing = "least_loaded"  # no engine keeps a prefix to be sent back to
        self.router: Router = make_router(
            routing, [client.num_kv_blocks for client in self.clients]
        )
        self._block_hasher = (
            make_block_hasher(setup.config.cache.block_size) if routing == "prefix" else None
        )

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    # ------------------------------------------------------------------ routing
    def add_request(self, request: EngineRequest) -> None:
        index = self.router.choose(
            self.prompt_block_hashes(request), engine_loads(self._in_flight, self._stats)
        )
        self.clients[index].add_request(request)
        self._owner[request.request_id] = index
        self._in_flight[index] += 1
        self.num_routed[index] += 1

    def prompt_block_hashes(self, request: EngineRequest) -> list[bytes]:
        """The hashes the engine will give the prompt's full blocks: the engine's own code on
        the same fields (tokens, cache salt), so that the router compares like with like."""
        if self._block_hasher is None:
            return []
        return Request.from_engine_request(request, self._block_hasher).block_hashes

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:  # None: finished meanwhile, nothing to abort
                self._in_flight[index] -= 1
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            self.clients[index].abort_requests(ids)

    def _account(self, outputs: EngineOutputs) -> EngineOutputs:
        if outputs.scheduler_stats is not None:
            self._stats[outputs.engine_index] = outputs.scheduler_stats
        for output in outputs.outputs:
            if output.finished and self._owner.pop(output.request_id, None) is not None:
                self._in_flight[outputs.engine_index] -= 1
        return outputs

    def get_output(self) -> EngineOutputs:
        return self._account(self._outputs.get())

    def call_utility(self, method: str, *args: Any) -> Any:
        """On every engine; booleans are and-ed (reset_prefix_cache), otherwise the first result."""
        return _combine(
            self._after_utility(
                method, [client.call_utility(method, *args) for client in self.clients]
            )
        )

    def _after_utility(self, method: str, results: list[Any]) -> list[Any]:
        if method == "reset_prefix_cache":
            for index, emptied in enumerate(results):
                if emptied is True:
                    self.router.forget(index)
        return results

    # ------------------------------------------------------------------ asyncio half
    async def add_request_async(self, request: EngineRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineOutputs:
        return self._account(await self._outputs.get_async())

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return _combine(await self.call_utility_each_async(method, *args))

    async def call_utility_each_async(self, method: str, *args: Any) -> list[Any]:
        results = await asyncio.gather(
            *(client.call_utility_async(method, *args) for client in self.clients)
        )
        return self._after_utility(method, list(results))

    # ------------------------------------------------------------------ lifetime
    @property
    def dead_error(self) -> EngineDeadError | None:
        for index, client in enumerate(self.clients):
            if client.dead_error is not None:
                return EngineDeadError(f"data-parallel engine {index}: {client.dead_error}")
        return None

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()

    def seconds_silent(self) -> list[float]:
        return [seconds for client in self.clients for seconds in client.seconds_silent()]

    def in_flight_per_engine(self) -> list[int] | None:
        return list(self._in_flight)

    def dump_engine_stacks(self) -> None:
        for client in self.clients:
            client.dump_engine_stacks()


def _for_engine(setup: EngineSetup, index: int) -> EngineSetup:
    parallel = dataclasses.replace(setup.config.parallel, data_parallel_rank=index)
    return dataclasses.replace(setup, config=dataclasses.replace(setup.config, parallel=parallel))


def engine_loads(in_flight: list[int], stats: list[SchedulerStats | None]) -> list[EngineLoad]:
    """Each engine's load (module docstring) for the router."""
    loads = []
    for count, engine in zip(in_flight, stats, strict=True):
        if engine is None:
            loads.append(EngineLoad(count))
        else:
            loads.append(
                EngineLoad(count + WAITING_WEIGHT * engine.num_waiting_reqs, engine.kv_cache_usage)
            )
    return loads


def _combine(results: list[Any]) -> Any:
    if all(isinstance(r, bool) for r in results):
        return all(results)
    return results[0]
