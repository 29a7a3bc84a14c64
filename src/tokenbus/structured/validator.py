"""Front-door check of structured-output specs: compile with a deadline (L2).

A spec that does not compile, or admits no output, is a ValueError (HTTP 400) before the request
reaches the engine; one whose compilation runs past the deadline is refused the same way.

Called from the server's preparation threads, never from its event loop. Each check runs in a
process of its own (compile_pool.py), one per slot: at its deadline, or when its client goes
away (CHECK_CANCELLED), the process is killed, so no compile outlives its request's budget and
a handful of pathological specs cannot hold every slot. Outcomes are remembered by spec (LRU):
errors, and a deadline passed (for NEGATIVE_TTL_S, as load may have been to blame), so a spec
seen before is answered at once; requests with a spec that is being checked wait for that check
instead of starting another.

xgrammar (which imports torch and transformers: seconds) is imported with the first spec, not
with this module: the API server imports this module, and its start-up is on the cold-start path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import threading
import time
from dataclasses import dataclass

import msgspec

from tokenbus.sampling_params import StructuredOutputsParams
from tokenbus.structured.compile_pool import (
    CheckCancelled,
    CheckerCrashed,
    CheckPool,
    CheckTimeout,
)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_MAX_CONCURRENT = 4
OUTCOME_CACHE_SIZE = 1024
# How long a spec whose check ran out of time is refused at once before it may be tried again.
NEGATIVE_TTL_S = 600.0

# Set (in a copied context) by code that validates on behalf of a client who may leave: once the
# event is set, the check is stopped and its slot freed. None: nobody can leave.
CHECK_CANCELLED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "tokenbus_check_cancelled", default=None
)


def spec_key(spec: StructuredOutputsParams) -> str:
    """A stable key for a spec (the outcome cache)."""
    return msgspec.json.encode(spec).decode()


@dataclass(frozen=True)
class Outcome:
    error: str | None  # None: the spec compiles
    expires_at: float = float("inf")  # time.monotonic()


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
        self._max_concurrent = max_concurrent
        self._pool: CheckPool | None = None  # built on first use: slow tokenizer work
        self._pool_lock = threading.Lock()
        # spec key → outcome; spec key → the check running (its result: the error or None).
        # Both guarded by _lock.
        self._outcomes: collections.OrderedDict[str, Outcome] = collections.OrderedDict()
        self._running: dict[str, concurrent.futures.Future[str | None]] = {}
        self._lock = threading.Lock()

    def validate(self, spec: StructuredOutputsParams) -> None:
        key = spec_key(spec)
        while True:
            with self._lock:
                outcome = self._cached(key)
                if outcome is not None:
                    if outcome.error is not None:
                        raise ValueError(outcome.error)
                    return
                future = self._running.get(key)
                is_owner = future is None
                if is_owner:
                    future = self._running[key] = concurrent.futures.Future()
            if is_owner:
                error = self._check(key, spec, future)
            else:
                try:
                    # The owner's check ends by its deadlines (slot, then compile): answered,
                    # refused or killed.
                    error = future.result(timeout=2 * self._timeout_s + 1)
                except CheckCancelled:
                    continue  # its owner's client left: check it for this one
                except concurrent.futures.TimeoutError:
                    error = self._too_slow()
            if error is not None:
                raise ValueError(error)
            return

    def close(self) -> None:
        """Kill the check processes (idle ones; a running check ends with its deadline)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()

    def _check(
        self, key: str, spec: StructuredOutputsParams, future: concurrent.futures.Future
    ) -> str | None:
        pool = self._get_pool()  # its start-up is not the spec's compile time
        try:
            outcome = Outcome(pool.check(spec, self._timeout_s, CHECK_CANCELLED.get()))
        except CheckTimeout:
            outcome = Outcome(self._too_slow(), time.monotonic() + NEGATIVE_TTL_S)
        except CheckerCrashed:
            outcome = Outcome(
                "structured_outputs: the grammar compiler crashed on this spec; simplify it"
            )
        except BaseException as exc:  # capacity, cancelled: not the spec's outcome
            with self._lock:
                self._running.pop(key, None)
            future.set_exception(exc)
            raise
        # Remembered and no longer running in one step: a request arriving meanwhile finds
        # one of the two.
        with self._lock:
            self._outcomes[key] = outcome
            self._outcomes.move_to_end(key)
            while len(self._outcomes) > OUTCOME_CACHE_SIZE:
                self._outcomes.popitem(last=False)
            self._running.pop(key, None)
        future.set_result(outcome.error)
        return outcome.error

    def _cached(self, key: str) -> Outcome | None:
        """The remembered outcome of `key`, if any and not expired (caller holds _lock)."""
        outcome = self._outcomes.get(key)
        if outcome is None:
            return None
        if outcome.expires_at <= time.monotonic():
            del self._outcomes[key]
            return None
        self._outcomes.move_to_end(key)
        return outcome

    def _too_slow(self) -> str:
        return (
            f"structured_outputs: grammar compilation took longer than {self._timeout_s:g} s; "
            f"simplify the schema/regex"
        )

    def _get_pool(self) -> CheckPool:
        with self._pool_lock:
            if self._pool is None:
                from tokenbus.structured.backend import tokenizer_info

                info = tokenizer_info(self._tokenizer, self._vocab_size)
                self._pool = CheckPool(info.serialize_json().encode(), self._max_concurrent)
            return self._pool
