"""UniProcExecutor: one worker, called directly in the EngineCore's process (L4)."""

from __future__ import annotations

from typing import Any

from tokenbus.core.outputs import ModelRunnerOutput, PendingOutput, ReadyOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.engine.executor.abstract import Executor, WorkerBase


class UniProcExecutor(Executor):
    def __init__(self, worker: WorkerBase) -> None:
        """`worker` is built but not started: its device and model phases run here."""
        self.worker = worker
        # A worker that can hand a step to the device and return before it ends (a fake
        # runs each step to its end).
        self._launch = getattr(worker, "launch_model", None)
        worker.init_device()
        worker.load_model()

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if method.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} is not a public worker method")
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)  # the hot path: no getattr

    def launch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        if self._launch is None:
            return ReadyOutput(self.worker.execute_model(scheduler_output))
        return self._launch(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
