"""q8_k activations on tiles (quant_tiles.c's tiles_q8k.h, AVX-512 VNNI): x rounded to int8 per 256
values, as llama.cpp's Q8_K. The kernel against dequantize-then-matmul on x rounded the same way,
for every tiled type at any row count; how quant_activations chooses it (auto: K-quant calls of
a prefill's size; int8 on AVX2, which has no q8_k); a K-quant GGUF model on that mode against
the dequantized model."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tests.model.test_quantized import DETECTED, SUPER_BLOCK_TYPES, TILE_TYPES, _logits, blocks

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

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the quantized kernels cannot be built here",
)


def q8_k_kernels():
    kernels = load_quant_kernels()
    if not kernels.q8_k:
        pytest.skip(f"q8_k needs AVX-512 with VNNI; this CPU is {DETECTED.describe()}")
    return kernels


def rounded_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x as the q8_k kernel sees it: each group of up to 256 values (8 blocks of 32; the last
    group of a row whose length is not a multiple of 256 is shorter) rounded to multiples of
    max|group| / 127."""
    out = torch.empty_like(x)
    for first in range(0, x.shape[1], 256):
        group = x[:, first : first + 256]
        amax = group.abs().amax(-1, keepdim=True)
        inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        out[:, first : first + 256] = (group * inverse).round() * (amax / 127)
    return out


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_q8_k_equals_dequantize_then_matmul_on_rounded_x(qtype):
    """Every tiled type (a partial last tile, K of 1 to 3 groups and a partial one), any number of
    rows (4 at a time, the rest fewer): the integer sums are exact, so the outputs equal
    dequantize-then-matmul of x rounded per 256 values up to fp32 rounding, and each row's
    result is the same bits whatever other rows share the call (row-local)."""
    kernels = q8_k_kernels()
    fmt = kernels.tile_format(int(qtype))
    shapes = (
        ((40, 256), (7, 768)) if qtype in SUPER_BLOCK_TYPES else ((40, 256), (33, 96), (5, 608))
    )
    for rows, cols in shapes:
        w = torch.from_numpy(blocks(qtype, rows, cols, seed=rows))
        dense = kernels.dequant_rows(int(qtype), w, cols, torch.arange(rows))
        tiles = kernels.repack_tiles(int(qtype), w, cols)
        previous = None
        for m in (1, 3, 4, 6, 70):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(0))
            x[:, 5] *= 30  # an outlier: its group's scale is coarse for the rest
            out = torch.full((m, rows + 3), float("nan"))[:, 1 : rows + 1]  # a column slice
            kernels.tile_matmul(fmt, tiles, rows, cols, x, out, "q8_k")
            want = rounded_q8_k(x) @ dense.T
            scale = 1e-4 * dense.abs().max().item() * x.abs().max().item()
            torch.testing.assert_close(out, want, rtol=1e-4, atol=scale)
            if previous is not None:
                assert torch.equal(out[: len(previous)], previous), (qtype.name, cols, m)
            previous = out


def test_q8_k_outputs_do_not_depend_on_the_thread_count():
    kernels = q8_k_kernels()
    w = torch.from_numpy(blocks(Q.Q4_K, 200, 512, seed=1))
    tiles = kernels.repack_tiles(int(Q.Q4_K), w, 512)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(3))
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty(37, 200)
            kernels.tile_matmul(int(Q.Q4_K), tiles, 200, 512, x, out, "q8_k")
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_quant_activations_choose_q8_k_for_k_quant_prefills():
    kernels = load_quant_kernels()
    dp, amx, vnni_only = (
        dataclasses.replace(kernels, bf16_engine=engine, isa="avx512", q8_k=True)
        for engine in ("avx512_bf16", "amx", "")
    )
    # AVX512-BF16 without AMX: K-quant calls from Q8_K_AUTO_MIN_ROWS on q8_k, others on bf16
    modes = quant_activation_modes("auto", dp)
    assert modes == TileModes(
        "int16",
        BF16_AUTO_MIN_ROWS["avx512_bf16"],
        GEMM_FROM_ROWS,
        k_quant_from_rows=Q8_K_AUTO_MIN_ROWS,
    )
    big = max(Q8_K_AUTO_MIN_ROWS, BF16_AUTO_MIN_ROWS["avx512_bf16"])
    assert [modes.mode(rows, k_quant=True) for rows in (1, Q8_K_AUTO_MIN_ROWS - 1, big)] == [
        "int16",
        "int16",
        "q8_k",
    ]
    assert modes.mode(big) == "bf16"  # a Q8_0 / Q4_1 shard of the same call
    # AMX's bf16 is far ahead of VNNI: it keeps every large call
    assert quant_activation_modes("auto", amx).k_quant_from_rows == 0
    # VNNI without a bf16 engine: int16 at any size, q8_k for K-quant prefills
    assert quant_activation_modes("auto", vnni_only) == TileModes(
        "int16", 0, 0, k_quant_from_rows=Q8_K_AUTO_MIN_ROWS
    )
    # explicit: every call; int8 takes tiles at any size where q8_k runs (VNNI pairs)
    assert quant_activation_modes("q8_k", dp) == TileModes("q8_k", 0, 0)
    assert quant_activation_modes("q8_k", dp).mode(1, k_quant=False) == "q8_k"
    assert quant_activation_modes("int8", dp) == TileModes("int8", 0, 0)
    assert quant_activation_modes("q8_k", dp, row_invariant=True) == TileModes("q8_k", 0, 0, True)
    no_vnni = dataclasses.replace(kernels, q8_k=False)
    with pytest.raises(ValueError, match="quant_activations 'q8_k' needs AVX-512 with VNNI"):
        quant_activation_modes("q8_k", no_vnni)


def test_quant_activations_choose_int8_for_k_quant_prefills_on_avx2():
    """AVX2 has neither q8_k nor a bf16 engine: the same K-quant calls take int8 (vpmaddubsw),
    the other types' and smaller calls int16; AVX-512 without VNNI keeps int16 throughout."""
    kernels = load_quant_kernels()
    avx2 = dataclasses.replace(kernels, bf16_engine="", isa="avx2", q8_k=False)
    modes = quant_activation_modes("auto", avx2)
    assert modes == TileModes(
        "int16", 0, 0, k_quant_from_rows=Q8_K_AUTO_MIN_ROWS, k_quant_activations="int8"
    )
    assert [modes.mode(rows, k_quant=True) for rows in (1, Q8_K_AUTO_MIN_ROWS - 1, 512)] == [
        "int16",
        "int16",
        "int8",
    ]
    assert modes.mode(512) == "int16"  # a Q8_0 / Q4_1 shard of the same call
    no_vnni = dataclasses.replace(avx2, isa="avx512")
    assert quant_activation_modes("auto", no_vnni) == TileModes("int16", 0, 0)
    # explicit modes and --batch-invariant are every call's, as elsewhere
    assert quant_activation_modes("int16", avx2) == TileModes("int16", 0, 0)
    assert quant_activation_modes("auto", avx2, row_invariant=True) == TileModes(
        "int16", 0, 0, True
    )


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_model_prefills_on_their_own_mode(tmp_path, qtype):
    """auto: a 40-token prefill's K-quant calls on q8_k (AVX-512 VNNI) or int8 (AVX2), the
    5-token one and the decodes on int16. q8_k's coarser x moves the logits by ~1e-2 of their
    norm (int8's, per 32 values, less); each greedy choice stays the dequantized model's or a
    near tie there."""
    kernels = load_quant_kernels()
    if kernels.tile_fns is None:
        pytest.skip(f"no tiled kernels on {DETECTED.describe()}")
    assert 5 < Q8_K_AUTO_MIN_ROWS <= 40
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    short, model = _logits(src, "gguf", "auto")
    modes = {
        m.kernel.modes
        for m in model.modules()
        if isinstance(m, Linear) and hasattr(m.kernel, "modes")
    }
    assert modes == {quant_activation_modes("auto", model.quant_kernels)}
    (modes,) = modes
    if model.quant_kernels.bf16_engine == "amx":
        assert modes.k_quant_from_rows == 0
        pytest.skip("AMX takes the prefill calls in bf16 (test_bf16_tiles.py)")
    if not modes.k_quant_from_rows:
        pytest.skip(f"K-quant calls take no mode of their own on {DETECTED.describe()}")
    assert modes.k_quant_from_rows == Q8_K_AUTO_MIN_ROWS
    assert modes.k_quant_activations == ("q8_k" if model.quant_kernels.q8_k else "int8")
    error = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    assert error(short, _logits(src, "none")[0]) < 1e-4  # every call below the threshold
    long_prompt, _ = _logits(src, "gguf", "auto", prompt_len=40)
    long_dequantized, _ = _logits(src, "none", prompt_len=40)
    assert 1e-5 < error(long_prompt, long_dequantized) < 5e-2
    chosen = long_dequantized.gather(1, long_prompt.argmax(-1, keepdim=True)).squeeze(1)
    assert (long_dequantized.max(-1).values - chosen < 0.1).all()


def test_the_library_names_the_super_block_formats():
    """K-quant tiles are named once, in kernels.h: the library answers for Python, so a linear's
    shards and decode_layer.c's steps pick the same calls for q8_k."""
    kernels = load_quant_kernels()
    if kernels.tile_fns is None:
        pytest.skip(f"no tiled kernels on {DETECTED.describe()}")
    tiled = {t for t in TILE_TYPES if kernels.tiles(t)}
    super_block = {t for t in tiled if kernels.super_block(kernels.tile_format(t))}
    assert super_block == tiled & set(SUPER_BLOCK_TYPES)
