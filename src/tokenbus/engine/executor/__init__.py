"""Executors: the EngineCore's one view of the workers that run the model (L4).

    UniProcExecutor   one Worker in the EngineCore's own process (tensor_parallel_size 1)
    MultiProcExecutor a spawned process per tensor-parallel rank (multiproc.py, imported lazily)
    RayExecutor       ranks as Ray actors in a placement group, across machines (ray_executor.py)

`make_executor` picks one from the ParallelConfig.
"""

from tokenbus.engine.executor.abstract import Executor, WorkerBase
from tokenbus.engine.executor.factory import make_executor
from tokenbus.engine.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "WorkerBase", "make_executor"]
