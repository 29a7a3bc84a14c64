"""Pick and start the EngineCore client for a front end and a process layout (L4).

Apart from the client modules (core_client, mp_client, dp_client) so that the base module never
imports its subclasses: the subclass modules import the base, this module imports them all.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenbus.engine.core_client import AsyncInprocClient, EngineCoreClient, InprocClient
from tokenbus.engine.core_proc import EngineFactory, make_engine_core
from tokenbus.engine.dp_client import DPLBClient
from tokenbus.engine.mp_client import AsyncMPClient, SyncMPClient

if TYPE_CHECKING:
    from tokenbus.engine.setup import EngineSetup


def make_engine_core_client(
    setup: EngineSetup,
    *,
    multiprocess: bool,
    asyncio_mode: bool,
    engine_factory: EngineFactory | None = None,
    ready_timeout_s: float | None = None,
    after_spawn: Callable[[], None] | None = None,
) -> EngineCoreClient:
    """Pick the client for a front end (sync LLMEngine or asyncio AsyncLLM) and a process layout.
    `after_spawn`: called once the engine processes have started, before waiting for them."""
    factory = engine_factory or make_engine_core
    num_engines = setup.config.parallel.data_parallel_size
    if num_engines > 1:
        if not multiprocess:
            raise ValueError(
                f"data_parallel_size={num_engines} runs each engine in its own process; "
                "it cannot be combined with an in-process engine (multiprocess=False, "
                "--engine-in-process)"
            )
        return DPLBClient(
            setup,
            factory,
            asyncio_mode=asyncio_mode,
            ready_timeout_s=ready_timeout_s,
            after_spawn=after_spawn,
        )
    if not multiprocess:
        return (
            AsyncInprocClient(setup, factory)
            if asyncio_mode
            else InprocClient(setup, factory(setup))
        )
    cls = AsyncMPClient if asyncio_mode else SyncMPClient
    return cls(setup, factory, ready_timeout_s=ready_timeout_s, after_spawn=after_spawn)


def start_engine(
    setup: EngineSetup,
    *,
    multiprocess: bool,
    asyncio_mode: bool,
    ready_timeout_s: float | None = None,
    while_starting: Callable[[], object] | None = None,
) -> tuple[Any, EngineCoreClient]:
    """The tokenizer and a ready client. An engine in its own process(es) starts while this
    process loads the tokenizer on a thread: its seconds (the transformers and torch imports, then
    the files) overlap the engine's start-up instead of preceding it, the largest cut in a
    server's cold start. `while_starting` runs on that thread next (the server's imports:
    api/openai/launch.py). An engine in this process is built after the tokenizer, and
    `while_starting` is not called."""
    from tokenbus.engine.setup import create_tokenizer

    if not multiprocess:
        tokenizer = create_tokenizer(setup)
        return tokenizer, make_engine_core_client(
            setup, multiprocess=False, asyncio_mode=asyncio_mode, ready_timeout_s=ready_timeout_s
        )
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        pending: list[concurrent.futures.Future] = []

        def after_spawn() -> None:
            pending.append(pool.submit(create_tokenizer, setup))
            if while_starting is not None:
                pending.append(pool.submit(while_starting))

        # Submitted once the engine has spawned: spawning briefly sets the engine's environment
        # (OpenMP, oneDNN) in this process, which a torch import on the thread must not read.
        client = make_engine_core_client(
            setup,
            multiprocess=True,
            asyncio_mode=asyncio_mode,
            ready_timeout_s=ready_timeout_s,
            after_spawn=after_spawn,
        )
        try:
            tokenizer = pending[0].result()
            for job in pending[1:]:
                job.result()
            return tokenizer, client
        except BaseException:
            client.shutdown()
            raise
