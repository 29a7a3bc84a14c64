"""Small interfaces the scheduler sees; the engine wires the real objects in (L1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenbus.core.outputs import KVConnectorOutput
    from tokenbus.core.request import Request
    from tokenbus.core.sched.output import SchedulerOutput


class GrammarManager(Protocol):
    """Structured output: grammar compilation, per-step bitmask, token acceptance."""

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (off the step loop)."""

    def is_ready(self, request: Request) -> bool:
        """True once the grammar compiled (a failed compile finishes the request with an error)."""

    def fill_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Put the bitmask rows of the constrained requests scheduled to sample into the output."""

    def validate_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """The longest prefix of draft tokens the request's grammar accepts (spec decode)."""

    def accept_tokens(self, request: Request, token_ids: list[int]) -> None:
        """Advance the request's matcher; a rejected token finishes it with an error."""

    def remove_request(self, request: Request) -> None:
        """Forget a finished request."""


class KVConnectorScheduler(Protocol):
    """The scheduler half of a KV connector (vLLM V1's shape; implementations in kv_transfer/).

    Per waiting request, before its blocks are allocated: `get_num_new_matched_tokens`; after:
    `update_state_after_alloc`. Per step: `build_connector_meta` (what the worker half must load
    and save; resets the step's state), then `update_connector_output` with what the worker half
    reported. When a request finishes: `request_finished`."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens past `num_computed_tokens` the connector can provide, load asynchronously?).
        None: cannot tell yet, ask again next step. No side effects. A synchronous load provides
        whole blocks and at most num_tokens - 1 tokens (the last is computed for its logits)."""

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's blocks are allocated (its whole table); load `num_external_tokens`
        into them after its first `num_computed_tokens` local ones."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes | None:
        """Encoded metadata for the worker half, for this step."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's report of the last step."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(keep the blocks until the worker reports them sent?, kv_transfer_params for the
        request's final output)."""

    def tier_occupancy(self) -> dict[str, int]:
        """Bytes held per tier of the connector's store, e.g. {"cpu": …, "disk": …}; {} if none."""
