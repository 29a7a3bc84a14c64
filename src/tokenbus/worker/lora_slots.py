"""Which LoRA adapter sits in which slot of the linears (L3).

The worker keeps the adapters it has read (up to max_cpu_loras; the least recently used one
that this step does not need is dropped first) and copies one into a slot of every linear
(model/lora.py) when a step needs it there and it is not there yet.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokenbus.config import LoRAConfig
from tokenbus.loader.lora import load_adapter
from tokenbus.model.kernel_plan import attach_lora
from tokenbus.model.layers import Linear
from tokenbus.model.lora import LORA_TARGETS, LinearLoRA, LoRABatch, LoRAPair
from tokenbus.model_arch import ModelArch


@dataclass(frozen=True)
class StepRun:
    """`num_rows` consecutive rows of a step that use one adapter (lora_id 0: none)."""

    lora_id: int
    lora_path: str | None
    num_rows: int


class LoRAAdapters:
    """A model's adapters: the loaded ones (id → pairs per linear) and which sit in slots."""

    def __init__(self, model: nn.Module, arch: ModelArch, config: LoRAConfig) -> None:
        self.arch = arch
        self.config = config
        self.batch = LoRABatch()
        dtype, self.device = model.embed_tokens.dtype, model.embed_tokens.device
        self.linears: dict[str, LinearLoRA] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.startswith("layers."):
                lora = LinearLoRA(module, self.batch, config, dtype, self.device)
                module.lora = self.linears[name] = lora
        attach_lora(model, self.batch)
        # id → {our linear's name → {shard → pair}}, most recently used last.
        self._loaded: OrderedDict[int, dict[str, dict[int, LoRAPair]]] = OrderedDict()
        self._slots: list[int] = [0] * config.max_loras  # adapter id per slot (0: empty)

    def set_batch(self, runs: Sequence[StepRun], num_rows: int) -> None:
        """This step's rows, as runs in batch order (rows past them, padding, use no adapter).
        Puts each adapter in a slot first, reading it if needed; at most max_loras differ (the
        scheduler's rule)."""
        paths = {run.lora_id: run.lora_path for run in runs if run.lora_id}
        if not paths:
            self.batch.groups, self.batch.slots = [], None
            return
        if len(paths) > len(self._slots):
            raise ValueError(f"{len(paths)} adapters in one step; max_loras is {len(self._slots)}")
        for lora_id in paths.keys() - set(self._slots):
            slot = next(i for i, held in enumerate(self._slots) if held not in paths)
            self._fill_slot(slot, self._adapter(lora_id, paths[lora_id], paths.keys()))
            self._slots[slot] = lora_id
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self._slots)}
        slots = torch.full((num_rows,), -1, dtype=torch.int64)
        row = 0
        for run in runs:
            if run.lora_id:
                slots[row : row + run.num_rows] = slot_of[run.lora_id]
            row += run.num_rows
        # Found on the host; a row list (not a slice) goes to the activations' device.
        groups = [(slot_of[i], _rows_of(slots, slot_of[i])) for i in paths]
        self.batch.groups = [
            (slot, rows if isinstance(rows, slice) else rows.to(self.device))
            for slot, rows in groups
        ]
        self.batch.slots = slots  # read by decode_layer.c, on CPU

    def _adapter(self, lora_id: int, path: str | None, keep) -> dict[str, dict[int, LoRAPair]]:
        """The adapter's pairs by linear, read once; past max_cpu_loras the least recently
        used one not in `keep` is dropped."""
        if lora_id in self._loaded:
            self._loaded.move_to_end(lora_id)
            return self._loaded[lora_id]
        if path is None:
            raise ValueError(f"LoRA adapter {lora_id} is not loaded and no path came with it")
        by_linear: dict[str, dict[int, LoRAPair]] = {}
        for module, pair in load_adapter(path, self.config.max_lora_rank, self.arch).items():
            layer, target = module.split(".")[2], module.rsplit(".", 1)[1]
            linear, shard = LORA_TARGETS[target]
            by_linear.setdefault(f"layers.{layer}.{linear}", {})[shard] = pair
        self._loaded[lora_id] = by_linear
        spare = [i for i in self._loaded if i not in keep]  # least recently used first
        for evicted in spare[: max(0, len(self._loaded) - self.config.num_cached_adapters)]:
            del self._loaded[evicted]
        return by_linear

    def _fill_slot(self, slot: int, adapter: dict[str, dict[int, LoRAPair]]) -> None:
        for name, linear in self.linears.items():
            linear.set_slot(slot, adapter.get(name, {}))


def _rows_of(slots: torch.Tensor, slot: int) -> slice | torch.Tensor:
    """The rows whose slot is `slot`: a slice when they are consecutive (the usual case: a
    step's requests are ordered by adapter), else their indices."""
    rows = (slots == slot).nonzero().flatten()
    first, last = int(rows[0]), int(rows[-1])
    return slice(first, last + 1) if last - first + 1 == rows.numel() else rows
