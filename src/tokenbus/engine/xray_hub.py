"""The front end's side of /xray: the latest snapshot of each engine (L4).

A value, never a queue: each engine's newest snapshot replaces the one before, and a viewer
reads whatever is newest when it is ready for more. A slow viewer skips snapshots; it never
holds the engine back or makes memory grow.
"""

from __future__ import annotations

import asyncio

from tokenbus.protocol import XraySnapshot


class XrayHub:
    def __init__(self) -> None:
        self._latest: dict[int, XraySnapshot] = {}
        self.version = 0  # bumped by every publish
        self._changed: asyncio.Event | None = None  # made in the event loop on first wait

    def publish(self, engine_index: int, snapshot: XraySnapshot) -> None:
        """Called in the event loop's thread (the output handler, a utility call's result)."""
        snapshot.engine_index = engine_index
        self._latest[engine_index] = snapshot
        self.version += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def latest(self) -> list[XraySnapshot]:
        """The newest snapshot of each engine that has sent one, by engine index."""
        return [self._latest[index] for index in sorted(self._latest)]

    async def wait_newer(self, version: int, timeout: float) -> int:
        """Return the hub's version once it is past `version`, or after `timeout` seconds."""
        if self.version > version:
            return self.version
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:  # noqa: UP041 (3.10: not yet the builtin)
            pass
        return self.version
