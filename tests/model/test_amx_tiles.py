"""bf16 activations on AMX (quant_tiles.c's amx_matmul): the kernel against dequantize-then-matmul
with both sides rounded to bf16, at any row count; how quant_activations chooses it; a GGUF model
on it against the dequantized model."""

from __future__ import annotations

import dataclasses
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.fixtures.tiny_models import cached_tiny_model, write_gguf
from tests.model.test_quantized import TILE_TYPES, _logits, blocks
from tokenbus.loader import resolve_model
from tokenbus.model.layers import Linear
from tokenbus.model.layers.quantized import AMX_AUTO_MIN_ROWS, tile_mode
from tokenbus.model.native import load_quant_kernels
from tokenbus.utils.cpu import CpuFeatures
from tokenbus.worker.model_loader import quant_activation_modes

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="no C compiler: the quantized kernels cannot be built here")


def amx_kernels():
    kernels = load_quant_kernels()
    if not kernels.amx:
        pytest.skip(f"bf16 tiles need AMX (amx_bf16, amx_tile, avx512_bf16) granted by the kernel; "
                    f"this CPU: {CpuFeatures.detect().describe()}")
    return kernels


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_amx_kernel_equals_bf16_rounded_reference(qtype):
    kernels = amx_kernels()
    for rows, cols in ((200, 576), (64, 128), (16, 64), (7, 1536)):  # odd/even tile counts, partial tiles, 48 blocks
        w = blocks(qtype, rows, cols, seed=rows)
        tiles = kernels.repack_tiles(int(qtype), torch.from_numpy(w), cols)
        dense = torch.from_numpy(gguf.quants.dequantize(w, qtype).astype(np.float32))
        for m in (1, 15, 16, 17, 32, 33, 49, 100, 300):  # partial A tiles, one and several 32-row groups
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            wide = torch.full((m, rows + 3), float("nan"))
            out = wide[:, 1:rows + 1]  # a column slice, like fused q/k/v
            kernels.tile_matmul(int(qtype), tiles, rows, cols, x, out, "bf16")
            want = x.bfloat16().float() @ dense.bfloat16().float().T  # fp32 sums of bf16 products
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            assert wide[:, 0].isnan().all() and wide[:, rows + 1:].isnan().all()  # nothing else written


def test_quant_activations_choose_bf16_only_on_amx():
    kernels = load_quant_kernels()
    with_amx, without = dataclasses.replace(kernels, amx=True), dataclasses.replace(kernels, amx=False)
    assert quant_activation_modes("auto", with_amx) == ("int16", AMX_AUTO_MIN_ROWS)
    assert quant_activation_modes("auto", without) == ("int16", 0)
    assert quant_activation_modes("bf16", with_amx) == ("bf16", 1)
    assert quant_activation_modes("int8", with_amx) == ("int8", 0)  # an explicit mode is kept everywhere
    with pytest.raises(ValueError, match="quant_activations 'bf16' needs AMX"):
        quant_activation_modes("bf16", without)
    assert [tile_mode("int16", 16, rows) for rows in (1, 15, 16, 500)] == ["int16", "int16", "bf16", "bf16"]
    assert tile_mode("int16", 0, 500) == "int16"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_model_on_amx(tmp_path, qtype):
    """auto: a 5-token prefill and the decodes on int16, a 40-token prefill on bf16; bf16: every
    call. bf16 rounds x and W to 8 bits of mantissa: the logits move by ~1e-3 of their norm, and
    each greedy choice stays the dequantized model's or a near tie there."""
    amx_kernels()
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    dequantized, _ = _logits(src, "none")
    auto, model = _logits(src, "gguf", "auto")
    assert {(m.kernel.activations, m.kernel.bf16_from_rows) for m in model.modules()
            if isinstance(m, Linear)} == {("int16", AMX_AUTO_MIN_ROWS)}
    bf16, _ = _logits(src, "gguf", "bf16")
    error = lambda got: ((got - dequantized).norm() / dequantized.norm()).item()  # noqa: E731
    assert error(auto) < 1e-4  # every call here is below AMX_AUTO_MIN_ROWS
    assert 1e-5 < error(bf16) < 1e-2
    chosen = dequantized.gather(1, bf16.argmax(-1, keepdim=True)).squeeze(1)
    assert (dequantized.max(-1).values - chosen < 0.1).all()
    long_prompt, _ = _logits(src, "gguf", "auto", prompt_len=40)
    long_dequantized, _ = _logits(src, "none", prompt_len=40)
    assert 1e-5 < ((long_prompt - long_dequantized).norm() / long_dequantized.norm()).item() < 1e-2
