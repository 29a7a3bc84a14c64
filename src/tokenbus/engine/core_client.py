"""Clients that talk to an EngineCore: one interface, in-process or in another process (L4).

    InprocClient       sync,    engine in this thread: get_output() runs one step (tests, debugging)
    AsyncInprocClient  asyncio, engine in a thread of this process (server --engine-in-process)
    SyncMPClient       sync,    engine in its own process (the offline LLM)     — mp_client.py
    AsyncMPClient      asyncio, engine in its own process (the server)          — mp_client.py
    DPLBClient         both,    N engine processes, load-balanced (data parallel) — dp_client.py

`client_factory.make_engine_core_client` picks one; `client_factory.start_engine` also loads the
tokenizer. This module imports neither subclass module (tests/engine/test_client_imports.py).
"""

from __future__ import annotations

import asyncio
import faulthandler
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.messages import (
    MessageType,
    RequestType,
    UtilityCall,
    UtilityResult,
    utility_error,
)
from tokenbus.protocol import EngineOutputs, EngineRequest

if TYPE_CHECKING:
    from tokenbus.engine.core import EngineCore  # at run time only where one is built here
    from tokenbus.engine.core_proc import EngineFactory
    from tokenbus.engine.setup import EngineSetup


class EngineCoreClient:
    """The sync methods serve LLMEngine, the `*_async` ones AsyncLLM; a client implements the
    half its front end uses."""

    num_kv_blocks: int

    def add_request(self, request: EngineRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineOutputs:
        """The outputs of the next step (blocks until there are some in a multi-process client)."""
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a public EngineCore method by name (reset_prefix_cache, check_integrity, ...)."""
        raise NotImplementedError

    async def add_request_async(self, request: EngineRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    async def call_utility_each_async(self, method: str, *args: Any) -> list[Any]:
        """The call on every engine, their results by engine index (one engine: one result)."""
        return [await self.call_utility_async(method, *args)]

    def seconds_silent(self) -> list[float]:
        """Per engine: seconds since it last sent anything (outputs, or the heartbeat its loop
        sends every second it has nothing else to say). Empty: not known (sync clients)."""
        return []

    def in_flight_per_engine(self) -> list[int] | None:
        """Per engine: requests routed there and not finished; None when there is one engine
        (the front end's own count is exact then)."""
        return None

    def dump_engine_stacks(self) -> None:
        """Have every engine log all its threads' stacks (a stall being investigated)."""

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set once the engine is gone; every later call raises it."""
        return None

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The EngineCore lives in this process; get_output runs one step."""

    def __init__(self, setup: EngineSetup, engine_core: EngineCore | None = None) -> None:
        from tokenbus.engine.core import EngineCore

        self.engine_core = engine_core or EngineCore(
            setup.config,
            setup.source,
            setup.arch,
            setup.eos_token_id,
            extra_eos_token_ids=setup.extra_eos_token_ids,
        )
        self.num_kv_blocks = self.engine_core.num_kv_blocks

    def add_request(self, request: EngineRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args):
        if method.startswith("_"):
            raise ValueError(f"utility {method!r} is not callable")
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# ---------------------------------------------------------------------- shared plumbing
class OutputChannel:
    """Hands EngineOutputs from a producer thread to one consumer: a blocking thread (`get`) or
    the asyncio loop that first calls `get_async`. An exception put in it is raised to every
    consumer from then on (engine death)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: queue.Queue[EngineOutputs | Exception] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[EngineOutputs | Exception] | None = None
        self._error: Exception | None = None  # kept for consumers on a later event loop

    def put(self, item: EngineOutputs | Exception) -> None:
        """Thread-safe; never blocks."""
        # Under the lock, so an item cannot slip into the sync queue after _bind_loop drained it.
        with self._lock:
            if isinstance(item, Exception):
                self._error = item
            if self._loop is None:
                self._sync.put(item)
                return
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

    def get(self) -> EngineOutputs:
        item = self._sync.get()
        if isinstance(item, Exception):
            self._sync.put(item)  # for the next waiter
            raise item
        return item

    async def get_async(self) -> EngineOutputs:
        self._bind_loop()
        item = await self._async.get()
        if isinstance(item, Exception):
            self._async.put_nowait(item)
            raise item
        return item

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        with self._lock:
            self._loop, self._async = loop, asyncio.Queue()
            while True:  # what arrived before any loop listened
                try:
                    self._async.put_nowait(self._sync.get_nowait())
                except queue.Empty:
                    break
            if self._error is not None:
                self._async.put_nowait(self._error)


class UtilityCalls:
    """Pending utility calls: call_id → Future, resolved by whoever reads the engine's replies;
    failed all at once when the engine dies, so no caller waits forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._futures: dict[int, Future] = {}
        self._error: Exception | None = None

    def start(self, method: str, args: tuple) -> tuple[UtilityCall, Future]:
        with self._lock:
            if self._error is not None:
                raise self._error
            call = UtilityCall(next(self._ids), method, list(args))
            future: Future = Future()
            self._futures[call.call_id] = future
        return call, future

    def resolve(self, result: UtilityResult) -> None:
        with self._lock:
            future = self._futures.pop(result.call_id, None)
        if future is None:
            return
        if result.error_type is None:
            future.set_result(result.result)
        else:
            future.set_exception(utility_error(result))

    def fail_all(self, error: Exception) -> None:
        with self._lock:
            self._error = error
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.set_exception(error)


# ---------------------------------------------------------------------- asyncio, in-process
class AsyncInprocClient(EngineCoreClient):
    """The EngineCore's busy loop in a thread of this process, fed through a queue: the event
    loop stays free while a step runs (torch releases the GIL), and only that thread touches
    the engine. Same loop as the engine process (`EngineCoreLoop`), minus the sockets."""

    def __init__(self, setup: EngineSetup, engine_factory: EngineFactory | None = None) -> None:
        from tokenbus.engine.core_proc import (
            EngineCoreLoop,
            make_engine_core,
            raise_in_loop_on_worker_death,
        )

        engine = (engine_factory or make_engine_core)(setup)
        self.num_kv_blocks = engine.num_kv_blocks
        self._inputs: queue.Queue[tuple[RequestType, Any]] = queue.Queue()
        self._outputs = OutputChannel()
        self._utilities = UtilityCalls()
        self._dead_error: EngineDeadError | None = None
        self._last_heard = time.monotonic()
        self._loop = EngineCoreLoop(engine, self._inputs, self._emit)
        raise_in_loop_on_worker_death(engine, self._inputs)
        self._thread = threading.Thread(target=self._run, name="EngineCoreThread", daemon=True)
        self._thread.start()

    def _emit(self, kind: MessageType, payload: Any) -> None:
        self._last_heard = time.monotonic()
        if kind is MessageType.OUTPUTS:
            self._outputs.put(payload)
        elif kind is MessageType.UTILITY_RESULT:
            self._utilities.resolve(payload)

    def _run(self) -> None:
        try:
            self._loop.run()
            error = EngineDeadError("the engine was shut down")
        except BaseException as exc:
            error = EngineDeadError(f"EngineCore died: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        finally:
            self._loop.engine.shutdown()
        self._dead_error = error
        self._utilities.fail_all(error)
        self._outputs.put(error)

    def _put(self, kind: RequestType, payload: Any) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        self._inputs.put((kind, payload))

    def add_request(self, request: EngineRequest) -> None:
        self._put(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._put(RequestType.ABORT, list(request_ids))

    async def add_request_async(self, request: EngineRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineOutputs:
        return await self._outputs.get_async()

    def call_utility(self, method: str, *args: Any) -> Any:
        call, future = self._utilities.start(method, args)
        self._put(RequestType.UTILITY, call)
        return future.result()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call, future = self._utilities.start(method, args)
        self._put(RequestType.UTILITY, call)
        return await asyncio.wrap_future(future)

    def seconds_silent(self) -> list[float]:
        return [time.monotonic() - self._last_heard]

    def dump_engine_stacks(self) -> None:
        faulthandler.dump_traceback(all_threads=True)  # the engine's thread is one of ours

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inputs.put((RequestType.SHUTDOWN, None))
            self._thread.join(timeout=10.0)
