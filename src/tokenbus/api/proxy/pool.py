"""The instances of one kind (prefill or decode): health, in-flight counts, the choice (L5).

Pure bookkeeping, no I/O: the router reports what it saw (`mark_down` after a connection
failure) and the health probe reports what /health said. All calls happen on the event loop
thread, and `acquire` chooses and counts in one synchronous step, so two requests arriving
together cannot both see the same instance as idle.
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


@dataclass(eq=False)  # identity: two instances are never the same one
class Instance:
    url: str  # base URL, no trailing slash
    kind: InstanceKind
    num_in_flight: int = 0  # requests of this proxy it is serving now (acquired, not released)
    is_healthy: bool = True  # optimistic at start: the first probe or request corrects it
    down_reason: str | None = None  # why it was last marked down (for logs and /health)


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

    def mark_down(self, instance: Instance, reason: str) -> None:
        if instance.is_healthy:
            logger.warning(
                "%s instance %s is down (%s): skipped until GET /health answers 200",
                self.kind.value,
                instance.url,
                reason,
            )
        instance.is_healthy = False
        instance.down_reason = reason

    def mark_up(self, instance: Instance) -> None:
        if not instance.is_healthy:
            logger.info(
                "%s instance %s is back (GET /health answered 200)", self.kind.value, instance.url
            )
        instance.is_healthy = True
        instance.down_reason = None
