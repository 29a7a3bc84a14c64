"""LoRA adapters on the server, as vLLM serves them (L5).

An adapter is a model name: `--lora-modules name=path` at start, or POST
/v1/load_lora_adapter {"lora_name", "lora_path"} while running (with
--enable-lora-runtime-updates, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); a request whose `model`
names one runs with it. /v1/models lists each adapter with the base model as its parent.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tokenbus.api.openai.errors import NotFoundError
from tokenbus.protocol import LoRARequest


def parse_lora_module(text: str) -> LoRARequest:
    """One --lora-modules value: name=path, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules: {text!r} is not valid JSON: {exc}") from exc
        if not isinstance(spec, dict) or not {"name", "path"} <= set(spec):
            raise ValueError(f'lora_modules: {text!r} needs "name" and "path"')
        return LoRARequest(str(spec["name"]), str(spec["path"]))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules: expected name=path, got {text!r}")
    return LoRARequest(name, path)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is never needed


class LoRAModules:
    """The adapters the server serves, by model name; every one checked against the model
    (config, names, ranks, shapes) before a request can name it."""

    def __init__(self, engine: Any, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}

    def add(self, lora: LoRARequest) -> None:
        if lora.lora_name in self.by_name or lora.lora_name in self.base_names:
            raise ValueError(f"The lora adapter '{lora.lora_name}' has already been loaded.")
        self.engine.input_processor.loras.check(lora.lora_name, lora.lora_path)
        self.by_name[lora.lora_name] = lora

    def remove(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")

    def get(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        return None if model is None else self.by_name.get(model)


def add_lora_routes(app: FastAPI, loras: LoRAModules) -> None:
    """vLLM's runtime adapter routes (only with --enable-lora-runtime-updates)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        # Reads the adapter's file headers: off the event loop.
        await asyncio.to_thread(loras.add, LoRARequest(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        loras.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
