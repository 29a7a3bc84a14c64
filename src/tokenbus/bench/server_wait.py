"""Waiting for a `tokenbus serve` that a benchmark script started to answer /health (L6)."""

from __future__ import annotations

import subprocess
import time
from typing import IO

import httpx


def wait_healthy(
    url: str,
    process: subprocess.Popen | None = None,
    log: IO[str] | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Until GET url/health answers 200; RuntimeError (with the log's tail) if `process` exits
    first, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = log.read()[-3000:]
            raise RuntimeError(f"server exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never became healthy")
