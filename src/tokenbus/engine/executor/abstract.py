"""The Executor interface and the phases every worker goes through (L4)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from tokenbus.core.outputs import ModelRunnerOutput, PendingOutput, ReadyOutput
from tokenbus.core.sched.output import SchedulerOutput


class WorkerBase(Protocol):
    """A worker is built in phases, in this order, each one called on every rank:

        init_device → load_model → determine_num_kv_blocks → initialize_kv_cache(n) → steps

    `determine_num_kv_blocks` measures what this rank's memory leaves for KV after its weights;
    the engine takes the minimum over ranks and hands the same `n` to all, so every rank's
    block ids mean the same slots. Tests pass fakes that sample fixed tokens."""

    def init_device(self) -> None: ...

    def load_model(self) -> None: ...

    def determine_num_kv_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Rank 0 returns the step's output; other ranks return None."""
        ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class Executor(ABC):
    """Runs each step on all workers and returns rank 0's output."""

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a public worker method on every rank; their results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def launch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start the step; its output is read with `.result()`. Executors whose workers run
        elsewhere run it to its end here."""
        return ReadyOutput(self.execute_model(scheduler_output))

    def determine_num_kv_blocks(self) -> int:
        """The pool size every rank can hold: the smallest rank's."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def check_health(self) -> None:
        """Raise if a worker is dead or unhealthy."""
        self.collective_rpc("check_health")

    # A no-op default, not abstract: executors whose workers can die alone override it.
    def register_failure_callback(self, callback: Callable[[], None]) -> None:  # noqa: B027
        """`callback()` runs (in another thread) as soon as a worker dies, so an idle engine
        learns of it without waiting for its next step. In-process workers cannot die alone."""

    # A no-op default, not abstract: executors with something to stop override it.
    def shutdown(self) -> None:  # noqa: B027
        """Stop every worker; safe to call twice."""
