"""Front-door check of structured-output specs: compile with a deadline (L2).

A spec that does not compile is a ValueError (HTTP 400) before the request reaches the engine;
one whose compilation runs past the deadline (a pathological regex) is refused the same way.

Called from the server's preparation threads, never from its event loop. Each compile runs on a
thread of its own: a compile past its deadline cannot be killed (xgrammar has no cancel), so it
keeps its thread and one of `max_concurrent` slots until it ends, while later specs compile on
the other slots instead of queueing behind it. Outcomes are remembered by spec (LRU) when the
compile ends, also one that ended past its deadline, so a spec seen before is answered at once;
requests with a spec that is being compiled wait for that compile instead of starting another.

xgrammar (which imports torch and transformers: seconds) is imported with the first spec, not
with this module: the API server imports this module, and its start-up is on the cold-start path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import TYPE_CHECKING

import msgspec

from tokenbus.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenbus.structured.backend import XgrammarBackend

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_MAX_CONCURRENT = 4
OUTCOME_CACHE_SIZE = 1024


def spec_key(spec: StructuredOutputsParams) -> str:
    """A stable key for a spec (the outcome cache)."""
    return msgspec.json.encode(spec).decode()


class CompileCapacityError(RuntimeError):
    """Every compile slot is taken (by slow compiles): retry later (HTTP 503)."""


class StructuredOutputValidator:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._backend: XgrammarBackend | None = None  # built on first use: slow tokenizer work
        self._backend_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        # spec key → None (compiles) or the error message; and the compiles running, by spec key.
        # Both guarded by _lock.
        self._outcomes: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def validate(self, spec: StructuredOutputsParams) -> None:
        key = spec_key(spec)
        with self._lock:
            if key in self._outcomes:
                self._outcomes.move_to_end(key)
                error = self._outcomes[key]
                if error is not None:
                    raise ValueError(error)
                return
            is_owner = key not in self._running
            if is_owner:
                self._running[key] = concurrent.futures.Future()
            future = self._running[key]
        if is_owner:
            self._get_backend()  # its tokenizer work is not the spec's compile time
            # Waiting for a slot counts against the same deadline as the compile itself.
            if not self._slots.acquire(timeout=self._timeout_s):
                error = CompileCapacityError(
                    "structured_outputs: every grammar compiler is busy; retry later"
                )
                with self._lock:
                    self._running.pop(key, None)
                future.set_exception(error)  # for those waiting on this compile
                raise error
            self._start_compile(key, spec, future)
        try:
            future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            # Not remembered: the compile goes on, and its outcome is what a retry gets.
            raise ValueError(
                f"structured_outputs: grammar compilation took longer than {self._timeout_s:g} s; "
                f"simplify the schema/regex"
            ) from None

    def _start_compile(
        self, key: str, spec: StructuredOutputsParams, future: concurrent.futures.Future
    ) -> None:
        def run() -> None:
            # Order: the outcome is remembered before the spec stops counting as running, so a
            # request arriving in between finds one of the two.
            result, error = None, None
            try:
                result = self._get_backend().compile(spec)
                self._remember(key, None)
            except ValueError as exc:  # the spec's fault: remembered
                self._remember(key, str(exc))
                error = exc
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, not remembered
                error = exc
            finally:
                with self._lock:
                    self._running.pop(key, None)
                self._slots.release()
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        threading.Thread(target=run, name="grammar-check", daemon=True).start()

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from tokenbus.structured.backend import XgrammarBackend

                self._backend = XgrammarBackend(self._tokenizer, self._vocab_size)
            return self._backend

    def _remember(self, key: str, error: str | None) -> None:
        with self._lock:
            self._outcomes[key] = error
            while len(self._outcomes) > OUTCOME_CACHE_SIZE:
                self._outcomes.popitem(last=False)
