"""Grammar checks in processes that can be killed: one per slot, replaced when killed (L2).

A check past its deadline (or whose client went away) is stopped by killing its process, so it
gives back its slot and its core at once instead of compiling on for minutes. Processes are
forked from a forkserver that has preloaded xgrammar: the first costs the server's start (about
as long as importing xgrammar), each later one milliseconds, so a killed process is replaced
before the next check needs it.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.connection import Connection

import msgspec

from tokenbus.sampling_params import StructuredOutputsParams
from tokenbus.utils.spawn import start_process

# How often a waiting check looks at its cancel event (seconds).
CANCEL_POLL_S = 0.05


class CheckReply(msgspec.Struct, frozen=True):
    error: str | None = None  # the spec's fault, worded for the client; None: it compiles


class CheckTimeout(Exception):
    """The check ran past its deadline; its process was killed."""


class CheckCancelled(Exception):
    """The caller gave up (its client went away); the process was killed."""


class CompileCapacityError(RuntimeError):
    """Every compile slot is taken (by slow compiles): retry later (HTTP 503)."""


class CheckerCrashed(Exception):
    """The process died during the check (a crash in the compiler, or killed from outside)."""


class CheckWorker:
    """One child process running compile_worker.serve; one check at a time."""

    def __init__(self, context: multiprocessing.context.BaseContext, info_json: bytes) -> None:
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child_conn,), name="tokenbus-grammar-check", daemon=True
        )
        start_process(self.process)
        child_conn.close()  # the child's end lives on in the child only: EOF when it dies
        self._conn.send_bytes(info_json)

    def check(
        self, message: bytes, deadline: float, cancelled: threading.Event | None
    ) -> str | None:
        """The spec's error, or None when it compiles. Raises CheckTimeout, CheckCancelled or
        CheckerCrashed; after any of them this worker is dead (the caller kills it)."""
        self._conn.send_bytes(message)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckTimeout
            wait = remaining if cancelled is None else min(remaining, CANCEL_POLL_S)
            try:
                if self._conn.poll(wait):
                    return msgspec.json.decode(self._conn.recv_bytes(), type=CheckReply).error
            except (EOFError, OSError):
                raise CheckerCrashed from None
            if cancelled is not None and cancelled.is_set():
                raise CheckCancelled

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self._conn.close()


def _serve(conn: Connection) -> None:
    from tokenbus.structured.compile_worker import serve

    serve(conn)


class CheckPool:
    """At most `size` checks at once, each in a process of its own."""

    def __init__(self, info_json: bytes, size: int) -> None:
        self._info_json = info_json
        self._context = multiprocessing.get_context("forkserver")
        # The forkserver imports this once; every worker forked from it starts with xgrammar.
        self._context.set_forkserver_preload(["tokenbus.structured.compile_worker"])
        self._size = size
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[CheckWorker] = []  # guarded by _lock
        self._lock = threading.Lock()
        self._closed = False
        self._put_idle(CheckWorker(self._context, info_json))  # start the forkserver now

    def check(
        self, spec: StructuredOutputsParams, timeout_s: float, cancelled: threading.Event | None
    ) -> str | None:
        """The spec's error or None. Up to `timeout_s` waiting for a slot (else
        CompileCapacityError), then up to `timeout_s` checking: the wait does not eat into the
        check's own time, or a trivial spec queued behind slow ones would be refused as slow.
        CheckTimeout / CheckCancelled / CheckerCrashed as CheckWorker.check."""
        self._acquire_slot(time.monotonic() + timeout_s, cancelled)
        try:
            worker = self._take_idle() or CheckWorker(self._context, self._info_json)
            deadline = time.monotonic() + timeout_s
            try:
                error = worker.check(msgspec.json.encode(spec), deadline, cancelled)
            except BaseException:
                worker.kill()
                # Replace it off this thread: the next check then finds one ready.
                threading.Thread(target=self._replace, name="grammar-check-start").start()
                raise
            self._put_idle(worker)
            return error
        finally:
            self._slots.release()

    def _acquire_slot(self, deadline: float, cancelled: threading.Event | None) -> None:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CompileCapacityError(
                    "structured_outputs: every grammar compiler is busy; retry later"
                )
            wait = remaining if cancelled is None else min(remaining, CANCEL_POLL_S)
            if self._slots.acquire(timeout=wait):
                return
            if cancelled is not None and cancelled.is_set():
                raise CheckCancelled

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take_idle(self) -> CheckWorker | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _put_idle(self, worker: CheckWorker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._size:
                self._idle.append(worker)
                return
        worker.kill()

    def _replace(self) -> None:
        if not self._closed:
            self._put_idle(CheckWorker(self._context, self._info_json))
