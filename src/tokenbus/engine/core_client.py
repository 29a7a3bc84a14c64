"""Clients that talk to an EngineCore: one interface, in-process or in another process (L4)."""

from __future__ import annotations

import abc

from tokenbus.engine.core import EngineCore
from tokenbus.engine.setup import EngineSetup
from tokenbus.protocol import EngineOutputs, EngineRequest


class EngineCoreClient(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: EngineRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def get_output(self) -> EngineOutputs:
        """The outputs of the next step (blocks until there are some in a multi-process client)."""

    @abc.abstractmethod
    def call_utility(self, method: str, *args):
        """Run an EngineCore method by name (reset_prefix_cache, check_integrity, ...)."""

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The EngineCore lives in this process; get_output runs one step."""

    def __init__(self, setup: EngineSetup) -> None:
        self.engine_core = EngineCore(setup.config, setup.source, setup.arch, setup.eos_token_id)

    def add_request(self, request: EngineRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args):
        if method.startswith("_"):
            raise ValueError(f"utility {method!r} is not callable")
        return getattr(self.engine_core, method)(*args)
