"""A spawned process (engine, tensor-parallel rank) exits when its parent dies (L0).

A parent killed without shutting its children down (SIGKILL, a crash) leaves them re-parented:
nobody reads their outputs, and staying up would keep the model's memory. Each child watches
its parent on a daemon thread and exits hard once it has gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

PARENT_POLL_S = 1.0  # how often a child checks that its parent is still alive


def exit_when_orphaned(parent_pid: int, cleanup: Callable[[], None] | None = None) -> None:
    """Block while `parent_pid` is this process's parent; then run `cleanup` and exit hard."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    if cleanup is not None:
        cleanup()
    os._exit(1)


def start_parent_watch(
    parent_pid: int, name: str, cleanup: Callable[[], None] | None = None
) -> threading.Thread:
    """Run exit_when_orphaned on a daemon thread named `name`."""
    thread = threading.Thread(
        target=exit_when_orphaned, args=(parent_pid, cleanup), daemon=True, name=name
    )
    thread.start()
    return thread
