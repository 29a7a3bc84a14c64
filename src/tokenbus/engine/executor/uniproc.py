"""UniProcExecutor: one worker, called directly in the EngineCore's process (L4)."""

from __future__ import annotations

from typing import Any

from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.engine.executor.abstract import Executor, WorkerBase


class UniProcExecutor(Executor):
    def __init__(self, worker: WorkerBase) -> None:
        """`worker` is built but not started: its device and model phases run here."""
        self.worker = worker
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

    def shutdown(self) -> None:
        self.worker.shutdown()
