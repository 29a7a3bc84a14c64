"""--quantization q8_0: a safetensors model's dense linear weights rounded to GGUF Q8_0 blocks at
load (llama.cpp's rounding), run on the quantized kernels and the C decoder layers."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from tests.fixtures.paged import PagedKV
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.engine.setup import resolve_config, resolve_quantization
from tokenbus.engine_args import EngineArgs
from tokenbus.loader import load_arch, resolve_model
from tokenbus.model.layers import Linear
from tokenbus.model.layers.linear import q8_0_blocks
from tokenbus.utils.cpu import CpuFeatures
from tokenbus.worker.model_builder import load_model

needs_tiles = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not CpuFeatures.detect().has("avx2", "fma"),
    reason="Q8_0 tiles need a C compiler and AVX2 + FMA",
)


def test_blocks_are_gguf_pys_q8_0():
    """The blocks are what gguf-py's Q8_0 quantizer (llama.cpp's reference rounding) writes,
    byte for byte, and read back within half a step of each block's scale."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=g) * torch.rand(48, 1, generator=g) * 3
    blocks = q8_0_blocks(weight)
    want = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert (blocks.rows, blocks.cols) == (48, 96) and blocks.qtype == 8
    assert np.array_equal(blocks.data.numpy(), want)
    back = gguf.quants.dequantize(want, gguf.GGMLQuantizationType.Q8_0)
    step = weight.abs().view(48, 3, 32).amax(-1, keepdim=True) / 127
    assert (torch.from_numpy(back).view(48, 3, 32) - weight.view(48, 3, 32)).abs().le(step).all()
    with pytest.raises(ValueError, match="need a matrix"):
        q8_0_blocks(weight[0])


def _logits(model, ids: list[int]) -> torch.Tensor:
    kv = PagedKV.for_model(model)
    out = []
    for batch in ([("a", ids)], [("a", [11])], [("a", [12])]):
        input_ids, ctx = kv.step(batch)
        with torch.inference_mode():
            out.append(model.compute_logits(model(input_ids, ctx)))
    return torch.cat(out)


@needs_tiles
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: an LM head tied to the embedding
def test_safetensors_linears_run_on_q8_0_tiles_in_c(family):
    path = cached_tiny_model(family, hidden_size=256, intermediate_size=512)
    src = resolve_model(str(path))
    dense = load_model(src, load_arch(src), torch.float32, "cpu", quantization="none")
    q8_0 = load_model(src, load_arch(src), torch.float32, "cpu", quantization="q8_0")
    linears = [m for m in q8_0.modules() if isinstance(m, Linear)]
    assert {m.backend for m in linears} == {"gguf"} and q8_0.lm_head in linears
    assert all(m.weight.numel() == 0 for m in linears)  # no dense copy kept beside the blocks
    assert q8_0.embed_quantized is not None and q8_0.embed_tokens.numel() == 0  # its rows too
    assert q8_0.decodes_in_c and q8_0.quant_kernels is not None
    want, got = _logits(dense, [5, 6, 7, 8, 9, 10]), _logits(q8_0, [5, 6, 7, 8, 9, 10])
    # Q8_0 weights and int16 activations: within a few hundredths of logits of unit scale
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # greedy picks agree up to near ties of the dense model's (random weights: many)
    rows = torch.arange(len(want))
    gaps = want[rows, want.argmax(-1)] - want[rows, got.argmax(-1)]
    assert gaps.max() < 2 * (got - want).abs().max()


def test_q8_0_resolves_on_cpu_only_and_needs_real_weights():
    src = resolve_model(str(cached_tiny_model("llama")))
    if shutil.which(os.environ.get("CC", "cc")) is not None:
        assert resolve_quantization("q8_0", src, "cpu") == "q8_0"
    with pytest.raises(ValueError, match="quantization 'q8_0': the quantized kernels run on CPU"):
        resolve_quantization("q8_0", src, "cuda:0")
    with pytest.raises(ValueError, match="not split for tensor parallelism"):
        resolve_quantization("q8_0", src, "cpu", tp=2)
    dummy = EngineArgs(model=str(src.path), quantization="q8_0", load_format="dummy")
    with pytest.raises(ValueError, match="'q8_0' needs real weights"):
        resolve_config(dummy.to_config(128), src)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model=str(src.path), quantization="q4_0").to_config(128)
