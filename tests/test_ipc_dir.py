"""IPC directories are named after their owner, and a new one is made after removing those
whose owner has gone (a SIGKILLed server leaves its own behind)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tokenbus.utils.ipc_dir import make_ipc_dir, process_start_time, remove_stale_ipc_dirs


@pytest.fixture
def root():
    # Short: a socket's path must fit in 107 bytes.
    with tempfile.TemporaryDirectory(prefix="tb") as path:
        yield Path(path)


def _ipc_dir(root: Path, pid: int, start: int, prefix: str = "tokenbus-") -> Path:
    """A directory as make_ipc_dir names them, holding a bound socket as the engine's do."""
    path = root / f"{prefix}{pid}-{start}-abcd_123"
    path.mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path / "input"))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="start times come from /proc")
def test_a_new_ipc_dir_removes_those_of_dead_owners_and_keeps_live_ones(root):
    me, parent = os.getpid(), os.getppid()
    my_start = process_start_time(me)
    assert my_start and process_start_time(_dead_pid()) is None
    dead = _ipc_dir(root, _dead_pid(), 12345)
    dead_ranks = root / f"tokenbus-tp-{_dead_pid()}-0-x1y2z3w4"  # empty: made, never bound
    dead_ranks.mkdir()
    reused = _ipc_dir(root, me, my_start + 1)  # its owner died; its pid is ours now
    live = _ipc_dir(root, me, my_start)
    live_other = _ipc_dir(root, parent, process_start_time(parent), "tokenbus-tp-")
    # Named like ours, but not ours to remove: a file in it is no socket; a plain file; a log.
    data = root / f"tokenbus-{_dead_pid()}-1-abcdefgh"
    data.mkdir()
    (data / "notes").write_text("keep")
    plain = root / f"tokenbus-{_dead_pid()}-1-qwertyui"
    plain.write_text("keep")
    log = root / "tokenbus-serve-abc.log"
    log.write_text("keep")

    new = Path(make_ipc_dir("tokenbus-", str(root)))

    assert new.name.startswith(f"tokenbus-{me}-{my_start}-") and new.is_dir()
    assert sorted(root.iterdir()) == sorted([live, live_other, data, plain, log, new])
    assert not dead.exists() and not dead_ranks.exists() and not reused.exists()
    assert remove_stale_ipc_dirs(str(root)) == []  # nothing left to remove


def test_only_the_two_ipc_prefixes_are_made():
    with pytest.raises(ValueError, match="prefix"):
        make_ipc_dir("tokenbus-kv-")
