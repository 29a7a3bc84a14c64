"""The engine's numbers for LoRA adapters (L4).

Each adapter a request names (a LoRARequest: name and path) gets a number the first time, after
its files were checked against the model from their headers: a bad adapter fails the request
that named it, never a worker. The front end keeps a registry too, to refuse such a request
with the reason before it is sent. Workers load an adapter by number the first time a request
of it reaches them (the path comes along); numbers are never reused, so a worker's copy of an
adapter is never confused with a later one of the same name.
"""

from __future__ import annotations

from tokenbus.config import LoRAConfig
from tokenbus.loader.lora import check_adapter
from tokenbus.model_arch import ModelArch
from tokenbus.protocol import LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, arch: ModelArch) -> None:
        self.config = config
        self.arch = arch
        self._ids: dict[LoRARequest, int] = {}

    def id_for(self, lora: LoRARequest | None) -> int:
        """The adapter's number (0: none); a ValueError naming lora_request when it cannot
        run here."""
        if lora is None:
            return 0
        if self.config is None:
            raise ValueError(
                f"lora_request: adapter {lora.lora_name!r} needs an engine started with "
                "enable_lora (--enable-lora)"
            )
        known = self._ids.get(lora)
        if known is not None:
            return known
        try:
            check_adapter(lora.lora_path, self.config.max_lora_rank, self.arch)
        except ValueError as exc:
            raise ValueError(f"lora_request: {exc}") from exc
        self._ids[lora] = len(self._ids) + 1
        return self._ids[lora]

    def check(self, lora_name: str, lora_path: str) -> int:
        """Check an adapter before requests name it (the server's --lora-modules and
        /v1/load_lora_adapter): its number, or a ValueError saying what is wrong."""
        return self.id_for(LoRARequest(lora_name, lora_path))
