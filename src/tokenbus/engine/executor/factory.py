"""Choosing and building the executor for a configuration (L4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbus.config import EngineConfig
from tokenbus.engine.executor.abstract import Executor
from tokenbus.model_arch import ModelArch

if TYPE_CHECKING:
    from tokenbus.loader import ModelSource


def make_executor(
    config: EngineConfig, source: ModelSource, arch: ModelArch, eos_token_id: int | None
) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        from tokenbus.engine.executor.uniproc import UniProcExecutor

        # Imported here: torch and the model loader are needed only when a real worker is
        # built, so processes that never build one (the API server, fake-worker tests) start fast.
        from tokenbus.worker.worker import Worker

        return UniProcExecutor(Worker(config, source, arch, eos_token_id))
    if backend == "mp":
        from tokenbus.engine.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config, source, arch, eos_token_id)
    if backend == "ray":
        from tokenbus.engine.executor.ray_executor import RayExecutor

        return RayExecutor(config, source, arch, eos_token_id)
    raise ValueError(
        f"distributed_executor_backend {backend!r} is not available yet "
        f"(tensor_parallel_size={config.parallel.tensor_parallel_size})"
    )
