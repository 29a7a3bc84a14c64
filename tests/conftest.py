"""Shared fixtures: tiny random-weight models built locally (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep torch from oversubscribing when pytest and engine threads overlap.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton's kernels run on CPU tensors in its interpreter, which must be on
# before triton is first imported (its own library functions are decorated at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tests.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from tests.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]
