"""Where a server's start-up goes, phase by phase, in one process (default model):
import torch, import the server's modules, read the GGUF header, load the tokenizer, start the
EngineCore process and wait for READY (model load, KV allocation, kernel load).

    .venv/bin/python benchmarks/startup_profile.py
"""

from __future__ import annotations

import time


def main() -> None:
    marks = [("start", time.perf_counter())]
    import torch  # noqa: F401

    marks.append(("import torch", time.perf_counter()))
    import tokenbus.api.openai.server  # noqa: F401
    from tokenbus.config import EngineArgs
    from tokenbus.engine.core_client import make_engine_core_client
    from tokenbus.engine.setup import create_engine_setup, create_tokenizer

    marks.append(("import the server's modules", time.perf_counter()))
    setup = create_engine_setup(EngineArgs())
    marks.append(("GGUF header, config", time.perf_counter()))
    create_tokenizer(setup)
    marks.append(("tokenizer", time.perf_counter()))
    client = make_engine_core_client(setup, multiprocess=True, asyncio_mode=True)
    marks.append(("EngineCore process ready", time.perf_counter()))
    client.shutdown()
    print(", ".join(f"{name} {end - begin:.2f} s" for (_, begin), (name, end) in zip(marks, marks[1:])))


if __name__ == "__main__":  # the EngineCore is a spawned process
    main()
