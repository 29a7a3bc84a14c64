"""Build a model on its device and dtype and fill it from its weight file(s) (L3).

Here, not in `loader`, because it joins two L2 siblings: `model` (the classes) and `loader`
(shapes and weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenbus.config import ModelArch
from tokenbus.loader import ModelSource, iter_weights
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.registry import get_model_class


def load_model(src: ModelSource, arch: ModelArch, dtype: torch.dtype, device: torch.device | str,
               attention_backend: str = "auto", tp: TensorParallel = SINGLE) -> nn.Module:
    """The whole model, or this rank's shard of it under tensor parallelism."""
    model_class = get_model_class(arch.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(arch, tp)  # parameters allocated uninitialised, in place
    model.load_weights(iter_weights(src, arch))  # casts to dtype on copy
    model.set_attention_backend(attention_backend)
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
