"""Small interfaces the scheduler sees; the engine wires the real objects in (L1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenbus.core.request import Request
    from tokenbus.core.sched.output import SchedulerOutput


class GrammarManager(Protocol):
    """Structured output: grammar compilation, per-step bitmask, token acceptance."""

    def add_request(self, request: "Request") -> None:
        """Start compiling the request's grammar (off the step loop)."""

    def is_ready(self, request: "Request") -> bool:
        """True once the grammar compiled (a failed compile finishes the request with an error)."""

    def fill_bitmask(self, scheduler_output: "SchedulerOutput", requests: dict[str, "Request"]) -> None:
        """Put the bitmask rows of the constrained requests scheduled to sample into the output."""

    def validate_tokens(self, request: "Request", token_ids: list[int]) -> list[int]:
        """The longest prefix of draft tokens the request's grammar accepts (spec decode)."""

    def accept_tokens(self, request: "Request", token_ids: list[int]) -> None:
        """Advance the request's matcher; a rejected token finishes it with an error."""

    def remove_request(self, request: "Request") -> None:
        """Forget a finished request."""
