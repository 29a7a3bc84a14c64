"""Where a server's start-up goes, phase by phase, in one process (default model), in the
order `tokenbus serve` runs them (api/openai/launch.py): import the start-up's modules (no torch,
no fastapi), read the GGUF header, then spawn the EngineCore process and wait for its READY (its
own torch import, model load, KV allocation, kernel load) while this process loads the tokenizer
(the transformers and torch imports, then the files) and then imports the HTTP server's modules
on a thread. The two sides overlap, so the thread's times are printed apart.

    .venv/bin/python benchmarks/startup_profile.py
"""

from __future__ import annotations

import importlib
import sys
import time


def main() -> None:
    marks = [("start", time.perf_counter())]
    from tokenbus.api.openai import launch
    from tokenbus.engine import client_factory
    from tokenbus.engine import setup as engine_setup
    from tokenbus.engine_args import EngineArgs

    marks.append(("import the start-up's modules", time.perf_counter()))
    setup = engine_setup.create_engine_setup(EngineArgs())
    marks.append(("GGUF header, config", time.perf_counter()))
    torch_before = "torch" in sys.modules
    done: dict[str, float] = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            result = fn(*args, **kwargs)
            done[name] = time.perf_counter()
            return result

        return run

    engine_setup.create_tokenizer = timed("tokenizer", engine_setup.create_tokenizer)
    client_factory.make_engine_core_client = timed("engine", client_factory.make_engine_core_client)
    server_import = timed("server", lambda: importlib.import_module(launch.SERVER_MODULE))
    _, client = client_factory.start_engine(
        setup, multiprocess=True, asyncio_mode=True, while_starting=server_import
    )
    marks.append(("both", time.perf_counter()))
    client.shutdown()
    spawned = marks[2][1]
    print(
        ", ".join(
            f"{name} {end - begin:.2f} s" for (_, begin), (name, end) in zip(marks, marks[1:-1])
        )
    )
    print(
        "then, side by side: EngineCore process ready after "
        f"{done['engine'] - spawned:.2f} s; on a thread, tokenizer loaded after "
        f"{done['tokenizer'] - spawned:.2f} s, the HTTP server's modules imported after "
        f"{done['server'] - spawned:.2f} s (torch {'already' if torch_before else 'not yet'} "
        "imported when the engine was spawned)"
    )


if __name__ == "__main__":  # the EngineCore is a spawned process
    main()
