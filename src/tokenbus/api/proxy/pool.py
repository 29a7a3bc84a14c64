"""The instances of one kind (prefill or decode): health, in-flight counts, the choice (L5).

Pure bookkeeping, no I/O: the router reports what it saw (`mark_down` after a connection
failure or a leg that timed out) and the health probe reports what /health said. All calls
happen on the event loop thread, and `acquire` chooses and counts in one synchronous step, so
two requests arriving together cannot both see the same instance as idle.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection
from dataclasses import dataclass

logger = logging.getLogger("tokenbus.proxy")


class InstanceKind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, eq=False)  # identity: each timeout's check is its own
class EngineCheck:
    """What the health probe needs to send an instance a request only its engine can answer:
    the model and key of the request that timed out there (a server with --api-key refuses
    the probe without one). Held only while the instance is down."""

    model: object  # the client's "model" field, as it came (the server judges it)
    authorization: str | None


@dataclass(eq=False)  # identity: two instances are never the same one
class Instance:
    url: str  # base URL, no trailing slash
    kind: InstanceKind
    num_in_flight: int = 0  # requests of this proxy it is serving now (acquired, not released)
    is_healthy: bool = True  # optimistic at start: the first probe or request corrects it
    down_reason: str | None = None  # why it was last marked down (for logs and /health)
    # Set while it is down because a leg timed out there: it took a request and did not answer.
    # Its API process may still answer /health 200 (its engine is stopped or hung), so /health
    # alone does not bring it back: the probe must get an answer from its engine too.
    engine_check: EngineCheck | None = None


class InstancePool:
    def __init__(self, kind: InstanceKind, urls: Collection[str]) -> None:
        self.kind = kind
        self.instances = [Instance(url, kind) for url in urls]
        self._next_index = 0  # round-robin start: ties go to the first instance from here on

    @property
    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.is_healthy]

    def acquire(self, exclude: Collection[Instance] = ()) -> Instance | None:
        """The healthy instance with the fewest requests in flight (ties: round robin), counted
        in flight until `release`; None when every healthy one is excluded or there is none."""
        n = len(self.instances)
        rotation = [self.instances[(self._next_index + k) % n] for k in range(n)]
        candidates = [i for i in rotation if i.is_healthy and i not in exclude]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: i.num_in_flight)  # min keeps the first of ties
        self._next_index = (self.instances.index(chosen) + 1) % n
        chosen.num_in_flight += 1
        return chosen

    def release(self, instance: Instance) -> None:
        assert instance.num_in_flight > 0, f"{instance.url}: released more often than acquired"
        instance.num_in_flight -= 1

    def mark_down(
        self, instance: Instance, reason: str, engine_check: EngineCheck | None = None
    ) -> None:
        """Out of rotation; with `engine_check` (a leg timed out) until its engine answers,
        else until GET /health answers 200. A check already set stays until one passes."""
        if engine_check is not None:
            instance.engine_check = engine_check  # the newest: its key is the likeliest valid
        if instance.is_healthy:
            logger.warning(
                "%s instance %s is down (%s): skipped until %s",
                self.kind.value,
                instance.url,
                reason,
                "its engine answers a probe"
                if instance.engine_check is not None
                else "GET /health answers 200",
            )
        instance.is_healthy = False
        instance.down_reason = reason

    def mark_up(self, instance: Instance, why: str = "GET /health answered 200") -> None:
        if not instance.is_healthy:
            logger.info("%s instance %s is back (%s)", self.kind.value, instance.url, why)
        instance.is_healthy = True
        instance.down_reason = None
        instance.engine_check = None
