"""Starting engine and rank processes so that they never depend on the user's main module (L0).

multiprocessing's spawn start method re-imports the parent's `__main__` in every child (to find
pickled functions defined there). For us that is never needed (every process target is a
tokenbus function) and often harmful:

    python - <<EOF … EOF      `__main__.__file__` is "<stdin>": the child dies with
                              FileNotFoundError
    a script without a main guard
                              the child re-runs it, LLM() inside starts another engine →
                              RuntimeError
    tokenbus serve            the CLI module is imported again: start-up time for nothing

So while Process.start() gathers the parent's state, `__main__` is a bare module of that name.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import sys
import types
from collections.abc import Iterator

from tokenbus.utils.cpu import engine_process_env


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = main


def start_process(proc: multiprocessing.process.BaseProcess) -> None:
    """Start a spawned engine or rank process: engine environment (cpu.engine_process_env),
    without re-importing the user's main module in the child."""
    with engine_process_env(), _main_module_hidden():
        proc.start()
