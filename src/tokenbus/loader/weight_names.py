"""Checkpoint tensors under the names our modules use (L2, no torch): one renaming of a layer's
modules that families whose HF names differ share (GLM-4's sandwich norms, HunYuan's q/k norms,
Apertus's layer norms)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def renamed_modules(
    weights: Iterator[tuple[str, Any]], names: Mapping[str, str]
) -> Iterator[tuple[str, Any]]:
    """Each <scope>.<module>.<leaf> tensor whose module is a key of `names` under that key's
    value; the others as they are."""
    for name, tensor in weights:
        scope, _, leaf = name.rpartition(".")  # model.layers.N[.self_attn].<module>, weight
        prefix, _, module = scope.rpartition(".")
        if module in names:
            name = f"{prefix}.{names[module]}.{leaf}"
        yield name, tensor
