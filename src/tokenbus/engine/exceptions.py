"""Errors the front ends raise about the engine itself, not about one request (L4)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore is gone (its process died, or it hit a fatal error): every in-flight and
    future request fails with this. Not recoverable: restart the engine (or the server)."""

    def __init__(
        self, message: str = "EngineCore died; see its log above for the root cause"
    ) -> None:
        super().__init__(message)
