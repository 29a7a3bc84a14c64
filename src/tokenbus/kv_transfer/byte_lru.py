"""ByteLRU (L2): the offloading tiers' bookkeeping, entries in use order bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Entries in use order (oldest first) with their byte total, bounded by `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, tuple[V, int]] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def get(self, key: bytes) -> V | None:
        """The value, now the most recently used; None if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def set_value(self, key: bytes, value: V) -> None:
        """Replace the value of a present key, keeping its place."""
        self._entries[key] = (value, self._entries[key][1])

    def put(self, key: bytes, value: V, nbytes: int) -> list[bytes]:
        """Insert (or replace) as the most recently used; returns the keys evicted to stay
        within capacity, oldest first (`key` itself if it alone exceeds it)."""
        self.pop(key)
        self._entries[key] = (value, nbytes)
        self.num_bytes += nbytes
        evicted = []
        while self.num_bytes > self.capacity:
            old_key, (_, old_bytes) = self._entries.popitem(last=False)
            self.num_bytes -= old_bytes
            evicted.append(old_key)
        return evicted

    def pop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        return True
