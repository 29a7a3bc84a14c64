"""bf16 activations on tiles (quant_tiles.c): AMX tiles (amx_matmul) and, where the CPU has no AMX
or the avx512_bf16 cap hides it, AVX512-BF16 dot products (dp_matmul). Each engine against
dequantize-then-matmul with both sides rounded to bf16, at any row count; how quant_activations
chooses bf16; a GGUF model on it against the dequantized model."""

from __future__ import annotations

import dataclasses
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tests.model.test_quantized import (
    DETECTED,
    SUPER_BLOCK_TYPES,
    TILE_TYPES,
    _logits,
    blocks,
)

from tokenbus.loader import resolve_model
from tokenbus.model.kernel_plan import quant_activation_modes
from tokenbus.model.layers import Linear
from tokenbus.model.layers.quantized import (
    BF16_AUTO_MIN_ROWS,
    GEMM_FROM_ROWS,
    Q8_K_AUTO_MIN_ROWS,
    TileModes,
)
from tokenbus.model.native import load_quant_kernels
from tokenbus.utils.cpu import CPU_ISA_ENV, CpuFeatures, _capped

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the quantized kernels cannot be built here",
)
# The engine each cap must give: native is AMX where the kernel grants it, else AVX512-BF16.
ENGINES = {"amx": "native", "avx512_bf16": "avx512_bf16"}


def bf16_kernels(engine: str):
    """Quant kernels whose bf16 activations run on `engine`, or a skip naming what is missing."""
    if not DETECTED.is_x86 or not DETECTED.has("avx512_bf16"):
        pytest.skip(
            "bf16 tiles need AVX512-BF16 (and AMX for the AMX engine); "
            f"this CPU: {DETECTED.describe()}"
        )
    cap = ENGINES[engine]
    kernels = load_quant_kernels(CpuFeatures(_capped(DETECTED.flags, cap), cap))
    if kernels.bf16_engine != engine:
        pytest.skip(
            f"the {engine} engine needs AMX (amx_bf16, amx_tile) granted by the kernel; "
            f"this CPU: {DETECTED.describe()}"
        )
    return kernels


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_bf16_kernel_equals_bf16_rounded_reference(qtype, engine):
    kernels = bf16_kernels(engine)
    # odd/even tile counts, partial tiles, 48 blocks (K-quants: rows of whole 256-value blocks)
    shapes = ((200, 576), (64, 128), (16, 64), (7, 1536))
    if qtype in SUPER_BLOCK_TYPES:
        shapes = ((200, 768), (64, 256), (16, 256), (7, 1536))
    for rows, cols in shapes:
        w = blocks(qtype, rows, cols, seed=rows)
        tiles = kernels.repack_tiles(int(qtype), torch.from_numpy(w), cols)
        dense = torch.from_numpy(gguf.quants.dequantize(w, qtype).astype(np.float32))
        for m in (
            1,
            7,
            8,
            9,
            15,
            16,
            17,
            32,
            33,
            49,
            100,
            300,
        ):  # partial register blocks and A tiles
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            wide = torch.full((m, rows + 3), float("nan"))
            out = wide[:, 1 : rows + 1]  # a column slice, like fused q/k/v
            kernels.tile_matmul(kernels.tile_format(int(qtype)), tiles, rows, cols, x, out, "bf16")
            want = x.bfloat16().float() @ dense.bfloat16().float().T  # fp32 sums of bf16 products
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            # nothing else written
            assert wide[:, 0].isnan().all() and wide[:, rows + 1 :].isnan().all()


def test_avx512_bf16_cap_builds_without_amx():
    """The cap keeps x86-64-v4 and the VNNI/BF16 extensions the CPU reports, nothing else: its
    kernels never take AMX, and a CPU without AVX512-BF16 gets no bf16 engine from it."""
    cpu = CpuFeatures(_capped(DETECTED.flags, "avx512_bf16"), "avx512_bf16")
    assert not any(flag.startswith("amx") for flag in cpu.flags)
    if not DETECTED.is_x86 or DETECTED.isa != "avx512":
        pytest.skip(
            f"an AVX-512 build needs AVX-512 F/BW/CD/DQ/VL; this CPU is {DETECTED.describe()}"
        )
    want = "avx512_bf16" if DETECTED.has("avx512_bf16") else ""
    assert load_quant_kernels(cpu).bf16_engine == want


def test_quant_activations_choose_bf16_only_with_an_engine():
    kernels = load_quant_kernels()
    amx, dp, none = (
        dataclasses.replace(kernels, bf16_engine=e, isa="avx512", q8_k=False)
        for e in ("amx", "avx512_bf16", "")
    )
    avx2, baseline = (
        dataclasses.replace(kernels, bf16_engine="", isa=isa, q8_k=False)
        for isa in ("avx2", "baseline")
    )
    assert quant_activation_modes("auto", amx) == TileModes(
        "int16", BF16_AUTO_MIN_ROWS["amx"], GEMM_FROM_ROWS
    )
    assert quant_activation_modes("auto", dp) == TileModes(
        "int16", BF16_AUTO_MIN_ROWS["avx512_bf16"], GEMM_FROM_ROWS
    )
    # no bf16 engine: int16 tiles at any size (AVX-512 and AVX2; AVX2's K-quant calls of 16+
    # rows on int8: test_q8k_tiles.py); a scalar build dequantizes past decode sizes
    assert quant_activation_modes("auto", none) == TileModes("int16", 0, 0)
    assert quant_activation_modes("auto", avx2) == TileModes(
        "int16", 0, 0, k_quant_from_rows=Q8_K_AUTO_MIN_ROWS, k_quant_activations="int8"
    )
    assert quant_activation_modes("auto", baseline) == TileModes("int16", 0, GEMM_FROM_ROWS)
    assert (
        quant_activation_modes("bf16", amx)
        == quant_activation_modes("bf16", dp)
        == TileModes("bf16", 1, 0)
    )
    # an explicit mode: kept
    assert quant_activation_modes("int8", amx) == TileModes("int8", 0, GEMM_FROM_ROWS)
    # an explicit int8/int16 takes its tiles at any size where auto's int16 does (no bf16 engine)
    assert (
        quant_activation_modes("int16", avx2)
        == quant_activation_modes("int16", none)
        == TileModes("int16", 0, 0)
    )
    assert (
        quant_activation_modes("int8", avx2)
        == quant_activation_modes("int8", none)
        == TileModes("int8", 0, 0)
    )
    # fp32 tiles: <= 64 rows
    assert quant_activation_modes("fp32", avx2) == TileModes("fp32", 0, GEMM_FROM_ROWS)
    with pytest.raises(ValueError, match="quant_activations 'bf16' needs AVX512-BF16"):
        quant_activation_modes("bf16", none)
    assert [TileModes("int16", 16, 0).mode(rows) for rows in (1, 15, 16, 500)] == [
        "int16",
        "int16",
        "bf16",
        "bf16",
    ]
    assert TileModes("int16", 0, 0).mode(500) == "int16"
    assert [
        TileModes("int16", 0, GEMM_FROM_ROWS).mode(rows)
        for rows in (1, GEMM_FROM_ROWS - 1, GEMM_FROM_ROWS)
    ] == ["int16", "int16", "gemm"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_model_on_bf16_tiles(tmp_path, monkeypatch, qtype, engine):
    """auto: a 5-token prefill and the decodes on int16, a 40-token prefill on bf16; bf16: every
    call. bf16 rounds x and W to 8 bits of mantissa: the logits move by ~1e-3 of their norm, and
    each greedy choice stays the dequantized model's or a near tie there."""
    bf16_kernels(engine)
    monkeypatch.setenv(CPU_ISA_ENV, ENGINES[engine])
    min_rows = BF16_AUTO_MIN_ROWS[engine]
    assert 5 < min_rows <= 40
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    dequantized, _ = _logits(src, "none")
    auto, model = _logits(src, "gguf", "auto")
    assert model.quant_kernels.bf16_engine == engine
    assert {
        (m.kernel.modes.activations, m.kernel.modes.bf16_from_rows)
        for m in model.modules()
        if isinstance(m, Linear)
    } == {("int16", min_rows)}
    bf16, _ = _logits(src, "gguf", "bf16")
    error = lambda got: ((got - dequantized).norm() / dequantized.norm()).item()  # noqa: E731
    assert error(auto) < 1e-4  # every call here is below min_rows
    assert 1e-5 < error(bf16) < 1e-2
    chosen = dequantized.gather(1, bf16.argmax(-1, keepdim=True)).squeeze(1)
    assert (dequantized.max(-1).values - chosen < 0.1).all()
    long_prompt, _ = _logits(src, "gguf", "auto", prompt_len=40)
    long_dequantized, _ = _logits(src, "none", prompt_len=40)
    assert 1e-5 < ((long_prompt - long_dequantized).norm() / long_dequantized.norm()).item() < 1e-2
