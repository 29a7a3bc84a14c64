"""Private directories for ipc:// socket files, named after their owner (L0).

    <tmp>/tokenbus-<pid>-<start>-<random>/       the front end's sockets to its engine
    <tmp>/tokenbus-tp-<pid>-<start>-<random>/    an engine's sockets to its tensor-parallel ranks

A process killed without its cleanup (SIGKILL, the OOM killer) leaves its directory behind, so
each new one is made after removing those whose owner has gone. <start> is the owner's start
time (clock ticks after boot, /proc/<pid>/stat field 22; 0 where there is no /proc): a pid the
system has handed to another process since does not keep a dead owner's directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

logger = logging.getLogger(__name__)

IPC_DIR_PREFIXES = ("tokenbus-", "tokenbus-tp-")
# mkdtemp's random part is 8 of [a-z0-9_]: nothing else of ours (logs, caches) matches.
_NAME = re.compile(r"tokenbus-(?:tp-)?(\d+)-(\d+)-[a-z0-9_]+")
_PROC = "/proc"


def make_ipc_dir(prefix: str, directory: str | None = None) -> str:
    """A new private directory owned by this process, in `directory` (default: the system's
    temporary directory), after removing the ones of owners that have gone."""
    if prefix not in IPC_DIR_PREFIXES:
        raise ValueError(f"prefix: expected one of {IPC_DIR_PREFIXES}, got {prefix!r}")
    directory = directory or tempfile.gettempdir()
    remove_stale_ipc_dirs(directory)
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{prefix}{pid}-{process_start_time(pid) or 0}-", dir=directory)


def remove_stale_ipc_dirs(directory: str | None = None) -> list[str]:
    """Remove this user's IPC directories in `directory` whose owner has gone; their paths.

    Only a directory named as make_ipc_dir names them, and holding nothing but sockets, is
    ever removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None or _owner_alive(int(match[1]), int(match[2])):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            if not _holds_only_sockets(entry.path):
                continue
        except OSError:
            continue  # gone meanwhile (another start removed it), or not ours to read
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        logger.info("removed IPC directories left by processes that died: %s", removed)
    return removed


def process_start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks after boot; None if it does not exist (or is a
    zombie: it has exited) or the system has no /proc."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its closing one.
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _holds_only_sockets(path: str) -> bool:
    with os.scandir(path) as entries:
        return all(stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode) for e in entries)


def _owner_alive(pid: int, start: int) -> bool:
    if os.path.isdir(f"{_PROC}/self"):
        actual = process_start_time(pid)
        return actual is not None and (start == 0 or actual == start)
    try:  # no /proc (macOS): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
