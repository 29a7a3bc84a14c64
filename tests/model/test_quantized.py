"""GGUF weights kept quantized: the native block kernels against dequantize-then-matmul, per
type, shape and CPU path; K-quant GGUF models; SmolLM2 greedy against HF on the same GGUF."""

from __future__ import annotations

import ctypes
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.fixtures.native_sources import copied_source
from tests.fixtures.tiny_gguf import random_k_quant_blocks, write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.engine.setup import resolve_quantization
from tokenbus.loader import iter_weights, load_arch, resolve_model
from tokenbus.loader.gguf_loader import QuantizedWeight
from tokenbus.model.layers import Linear
from tokenbus.model.layers.quantized import (
    GEMM_FROM_ROWS,
    INT_TILES_ANY_ROWS_ISAS,
    QUANT_GEMV_MAX_ROWS,
    TILE_GEMV_MAX_ROWS,
    QuantizedLinearKernel,
)
from tokenbus.model.native import load_quant_kernels
from tokenbus.utils.cpu import CpuFeatures, _capped
from tokenbus.worker.model_builder import load_model

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the quantized kernels cannot be built here",
)
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
DETECTED = CpuFeatures.detect()


def blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    if qtype.name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"):
        data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(data, qtype)
    return random_k_quant_blocks(qtype.name, rows, cols, seed)


def kernels_for(cap: str):
    if cap != "native" and not DETECTED.is_x86:
        pytest.skip("ISA caps apply to x86-64 only")
    if cap == "avx512" and DETECTED.isa != "avx512":
        pytest.skip(
            f"an AVX-512 build needs AVX-512 F/BW/CD/DQ/VL; this CPU is {DETECTED.describe()}"
        )
    return load_quant_kernels(CpuFeatures(_capped(DETECTED.flags, cap), cap))


@pytest.mark.parametrize(
    "cap", ["native", "avx512", "avx2", "baseline"]
)  # SIMD paths and the generic one
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_dequantize_then_matmul(qtype, cap):
    kernels = kernels_for(cap)
    for rows, cols in ((40, 256), (7, 512)):
        w = blocks(qtype, rows, cols, seed=rows)
        dense = torch.from_numpy(gguf.quants.dequantize(w, qtype).astype(np.float32))
        ids = torch.tensor([rows - 1, 0, 3, 3])
        assert torch.equal(
            kernels.dequant_rows(int(qtype), torch.from_numpy(w), cols, ids), dense[ids]
        )
        for m in (1, 5, 16, 64):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            out = torch.full((m, rows + 3), float("nan"))[
                :, 1 : rows + 1
            ]  # a column slice, like fused q/k/v
            kernels.matmul(int(qtype), torch.from_numpy(w), cols, x, out)
            torch.testing.assert_close(
                out, x @ dense.T, rtol=1e-4, atol=1e-4 * dense.abs().max().item()
            )


TILE_TYPES = [
    *(Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4),
    *(Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS),
]
# Bytes per 256 values of a row, (in the GGUF file, in tiles), where they differ: the K-quants'
# 6-bit sub-block scales become bytes, and Q3_K takes Q6_K's format (quant_tiles.c's Repacking;
# docs/cpu.md).
TILE_BYTES = {
    Q.Q3_K: (110, 210),
    Q.Q4_K: (144, 148),
    Q.Q5_K: (176, 180),
    Q.IQ4_XS: (136, 138),
}
# Types in 256-value super-blocks: rows of whole ones.
SUPER_BLOCK_TYPES = (Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


def rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x as an integer-activation kernel sees it: each 32-value block rounded to multiples of
    max|block| / levels (127: int8, 32767: int16)."""
    blocks_ = x.reshape(x.shape[0], -1, 32)
    amax = blocks_.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    return ((blocks_ * inverse).round() * (amax / levels)).reshape(x.shape)


@pytest.mark.parametrize(
    "cap", ["native", "avx512", "avx2"]
)  # VNNI where the CPU has it; vpmaddubsw
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_tiled_kernels_equal_dequantize_then_matmul(qtype, cap):
    """16-row tiles (a partial last tile too): repacking keeps every value; fp32 activations
    equal dequantize-then-matmul to rounding, int8 and int16 ones equal it on x rounded as the
    kernel does, at any number of rows (64 at a time), and each row's result is the same bits
    whatever else is in the batch."""
    kernels = kernels_for(cap)
    assert kernels.tiles(int(qtype)), f"no tiled kernels on {DETECTED.describe()} capped to {cap}"
    shapes = (
        ((40, 256), (7, 512)) if qtype in SUPER_BLOCK_TYPES else ((40, 256), (7, 512), (64, 96))
    )
    fmt = kernels.tile_format(int(qtype))  # what the tile kernels take
    for rows, cols in shapes:
        w = torch.from_numpy(blocks(qtype, rows, cols, seed=rows))
        dense = kernels.dequant_rows(int(qtype), w, cols, torch.arange(rows))
        tiles = kernels.repack_tiles(int(qtype), w, cols)
        gguf_bytes, tile_bytes = TILE_BYTES.get(qtype, (1, 1))
        assert tiles.numel() == -(-rows // 16) * 16 * w.shape[1] * tile_bytes // gguf_bytes
        ids = torch.tensor([rows - 1, 0, 3, 3])
        assert torch.equal(kernels.tile_dequant_rows(fmt, tiles, rows, cols, ids), dense[ids])
        weight_t = torch.full((cols, tiles.shape[0] * 16 + 5), float("nan"))[:, 2:-3]  # row-strided
        kernels.tile_dequant_t(fmt, tiles, rows, cols, 0, weight_t)
        assert torch.equal(weight_t[:, :rows], dense.T) and not weight_t[:, rows:].any()
        outs = {}
        for m in (1, 5, 16, 64, 150):
            x = torch.randn(
                m, cols, generator=torch.Generator().manual_seed(0)
            )  # row i the same in every m
            scale = 1e-4 * dense.abs().max().item()
            for activations, want in (
                ("fp32", x @ dense.T),
                ("int8", rounded(x, 127) @ dense.T),
                ("int16", rounded(x, 32767) @ dense.T),
            ):
                if activations == "fp32" and m > 64:
                    continue
                out = torch.full((m, rows + 3), float("nan"))[:, 1 : rows + 1]  # a column slice
                kernels.tile_matmul(fmt, tiles, rows, cols, x, out, activations)
                torch.testing.assert_close(out, want, rtol=1e-4, atol=scale * x.abs().max().item())
                # The previous (smaller) call's rows, here among more: one row goes alone, int16 4
                # rows at a time, int8 on Q4 without VNNI 4 at a time from 8 rows (tile_q4a).
                previous = outs.get(activations, out)
                assert torch.equal(out[: len(previous)], previous), (activations, m)
                outs[activations] = out


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_outputs_do_not_depend_on_the_thread_count(qtype):
    """Threads take tiles (GGUF rows for K-quants) as they come free; each output column is
    still one thread's whole sum, so 1, 2 or 3 threads give the same bits."""
    kernels = load_quant_kernels()
    rows, cols = 200, 256
    w = torch.from_numpy(blocks(qtype, rows, cols, seed=1))
    tiled = kernels.tiles(int(qtype))
    tiles = kernels.repack_tiles(int(qtype), w, cols) if tiled else None
    modes = ["rows"] + (
        ["fp32", "int8", "int16"] + (["bf16"] if kernels.bf16_engine else []) if tiled else []
    )
    before = torch.get_num_threads()
    try:
        for m in (1, 16, 40, 100):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            for mode in (
                modes if m <= 64 else [mode for mode in modes if mode not in ("rows", "fp32")]
            ):
                outs = []
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    out = torch.empty(m, rows)
                    if mode == "rows":
                        kernels.matmul(int(qtype), w, cols, x, out)
                    else:
                        kernels.tile_matmul(int(qtype), tiles, rows, cols, x, out, mode)
                    outs.append(out)
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (qtype.name, mode, m)
    finally:
        torch.set_num_threads(before)


def test_no_tiles_below_avx2():
    """The portable build has no tiled kernels: every type stays in GGUF rows."""
    if not DETECTED.is_x86:
        pytest.skip("ISA caps apply to x86-64 only")
    kernels = kernels_for("baseline")
    assert not any(kernels.tiles(int(t)) for t in TILE_TYPES)


def test_tile_kernels_from_another_source(tmp_path):
    """load_quant_kernels(tile_source=...) builds a quant_tiles.c from elsewhere with the headers
    beside it (how benchmarks/quant_linear.py --baseline times an older revision's kernels): a
    copy there is a second library, and gives the same bits as the package's own build."""
    kernels = load_quant_kernels()
    if not kernels.tiles(int(Q.Q4_1)):
        pytest.skip(f"no tiled kernels on {DETECTED.describe()}")
    other = load_quant_kernels(tile_source=copied_source("quant_tiles.c", tmp_path))
    address = lambda build: ctypes.cast(build.tile_fns["matmul"], ctypes.c_void_p).value  # noqa: E731
    assert address(other) != address(kernels)  # two libraries loaded side by side
    w = torch.from_numpy(blocks(Q.Q4_1, 40, 256))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    outs = []
    for build in (kernels, other):
        out = torch.empty(3, 40)
        build.tile_matmul(
            int(Q.Q4_1), build.repack_tiles(int(Q.Q4_1), w, 256), 40, 256, x, out, "int16"
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_unsupported_shapes_and_types_are_errors():
    kernels = load_quant_kernels()
    w = torch.from_numpy(blocks(Q.Q4_K, 4, 256))
    with pytest.raises(ValueError, match="GGML type 16 with 256 columns is not supported"):
        kernels.matmul(int(Q.IQ2_XXS), w, 256, torch.zeros(1, 256), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="GGML type 12 with 200 columns"):  # not a multiple of 256
        kernels.dequant_rows(int(Q.Q4_K), w, 200, torch.tensor([0]))


def test_fused_linear_mixes_types_and_switches_to_gemm_for_big_batches():
    kernels = load_quant_kernels()
    shards = [
        QuantizedWeight(int(t), torch.from_numpy(blocks(t, n, 256, seed=n)), 256)
        for t, n in ((Q.Q4_1, 24), (Q.Q6_K, 8), (Q.Q8_0, 8))
    ]
    dense = torch.cat(
        [
            torch.from_numpy(gguf.quants.dequantize(s.data.numpy(), Q(s.qtype)).astype(np.float32))
            for s in shards
        ]
    )
    bias = torch.randn(40)
    linear = Linear(256, [24, 8, 8], bias=True)
    for shard, weight in enumerate(shards):
        linear.load_shard(f"w{shard}", weight, shard)
    with torch.no_grad():
        linear.bias.copy_(bias)
    linear.finalize(quant_kernels=kernels)
    assert linear.backend == "gguf" and linear.weight.numel() == 0  # no dense copy kept
    assert isinstance(linear._kernel, QuantizedLinearKernel)
    # The block kernels; the K-quant shard's GEMM with the tiles' kernels; every shard's GEMM.
    for m in (3, QUANT_GEMV_MAX_ROWS + 5, TILE_GEMV_MAX_ROWS + 3):
        x = torch.randn(2, m, 256)
        torch.testing.assert_close(linear(x), x @ dense.T + bias, rtol=1e-4, atol=1e-4)
    # force row chunks (10 rows, 16 on tiles) across shard edges
    linear._kernel.buffer.MAX_VALUES = 10 * 256
    x = torch.randn(TILE_GEMV_MAX_ROWS + 1, 256)
    torch.testing.assert_close(linear(x), x @ dense.T + bias, rtol=1e-4, atol=1e-4)


def test_reloading_a_quantized_linear_rebuilds_its_kernel():
    """finalize() after new blocks were loaded runs on them, not on nothing (the dense weight
    was released at the first finalize)."""
    kernels = load_quant_kernels()
    first, second = (
        QuantizedWeight(int(Q.Q8_0), torch.from_numpy(blocks(Q.Q8_0, 24, 256, seed=s)), 256)
        for s in (1, 2)
    )
    linear = Linear(256, [24])
    linear.load_shard("w", first)
    linear.finalize(quant_kernels=kernels)
    linear.load_shard("w", second)
    linear.finalize(quant_kernels=kernels)
    dense = torch.from_numpy(gguf.quants.dequantize(second.data.numpy(), Q.Q8_0).astype(np.float32))
    x = torch.randn(3, 256)
    torch.testing.assert_close(linear(x), x @ dense.T, rtol=1e-4, atol=1e-4)


def _logits(
    src, quantization: str, quant_activations: str = "fp32", prompt_len: int = 5
) -> torch.Tensor:
    """Logits of a `prompt_len`-token prefill, then 4 decodes."""
    from tests.fixtures.paged import PagedKV
    from tests.model.test_llama_vs_hf import run

    model = load_model(
        src,
        load_arch(src),
        torch.float32,
        "cpu",
        quantization=quantization,
        quant_activations=quant_activations,
    )
    ids = [101 * (i + 1) % 997 for i in range(prompt_len)] + [606, 707, 808, 909]
    kv = PagedKV.for_model(model)
    return torch.cat(
        [run(model, kv, [("a", ids[:prompt_len])])]
        + [run(model, kv, [("a", [t])]) for t in ids[prompt_len:]]
    ), model


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K"])
def test_gguf_model_quantized_equals_dequantized(tmp_path, qtype):
    """A GGUF of each type (K-quants need 256-wide rows), run on its blocks and dequantized."""
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    weights = dict(iter_weights(src, load_arch(src), keep_quantized=True))
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], QuantizedWeight)
    assert isinstance(weights["model.norm.weight"], torch.Tensor)
    quantized, model = _logits(src, "gguf")
    assert {m.backend for m in model.modules() if isinstance(m, Linear)} == {"gguf"}
    assert model.embed_tokens.numel() == 0 and model.embed_quantized is not None
    dequantized, _ = _logits(src, "none")
    torch.testing.assert_close(quantized, dequantized, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_model_on_integer_activations(tmp_path, qtype):
    """int16 activations (the default) round each 32-value block of x to 1/65534 of its largest
    value: the logits stay the weight-only model's to ~1e-4. int8 (llama.cpp's) rounds to 1/254:
    they move by a few percent on a random model, its greedy choices stay near ties."""
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    dequantized, _ = _logits(src, "none")
    default, model = _logits(src, "gguf", "auto")
    if not model.quant_kernels.tiles(int(Q[qtype])):
        pytest.skip(
            f"no tiled kernels on this CPU ({DETECTED.describe()}): "
            "integer activations do not apply"
        )
    assert {m.kernel.modes.activations for m in model.modules() if isinstance(m, Linear)} == {
        "int16"
    }
    # Without a bf16 engine (AVX2, AVX-512) prefill chunks past 64 rows stay on int16 tiles as well.
    any_rows = (
        model.quant_kernels.isa in INT_TILES_ANY_ROWS_ISAS and not model.quant_kernels.bf16_engine
    )
    assert {m.kernel.modes.gemm_from_rows for m in model.modules() if isinstance(m, Linear)} == {
        0 if any_rows else GEMM_FROM_ROWS
    }
    error = lambda got: ((got - dequantized).norm() / dequantized.norm()).item()  # noqa: E731
    assert 0 < error(default) < 1e-4
    # A 100-row prefill: int16 tiles (AVX2, AVX-512) or the fp32 GEMM stay within 1e-4; where the
    # CPU has a bf16 engine, auto takes bf16 there (test_bf16_tiles.py), within its 1e-2.
    long_prompt, _ = _logits(src, "gguf", "auto", prompt_len=100)
    long_dequantized, _ = _logits(src, "none", prompt_len=100)
    long_tolerance = 1e-2 if model.quant_kernels.bf16_engine else 1e-4
    assert (
        0
        < ((long_prompt - long_dequantized).norm() / long_dequantized.norm()).item()
        < long_tolerance
    )
    int8, _ = _logits(src, "gguf", "int8")
    assert (
        1e-4 < error(int8) < 3e-2
    )  # not the fp32 path, and close to it (a random model: worst case)
    # Each greedy choice is the dequantized model's, or a near tie there (0.1 nats, the oracle's
    # gap).
    chosen = dequantized.gather(1, int8.argmax(-1, keepdim=True)).squeeze(1)
    assert (dequantized.max(-1).values - chosen < 0.1).all()


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_integer_activations_need_gguf_blocks(activations):
    src = resolve_model(str(cached_tiny_model("llama")))
    with pytest.raises(
        ValueError, match=f"quant_activations '{activations}' needs GGUF weights kept quantized"
    ):
        load_model(
            src,
            load_arch(src),
            torch.float32,
            "cpu",
            quantization="auto",
            quant_activations=activations,
        )


def test_quantization_choice_and_its_errors(tmp_path):
    hf_src = resolve_model(str(cached_tiny_model("llama")))
    gguf_src = resolve_model(
        str(
            write_gguf(
                cached_tiny_model("llama"), tmp_path / "m.gguf", "Q8_0", with_tokenizer=False
            )
        )
    )
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", gguf_src, cpu) == "gguf"
    assert resolve_quantization("auto", hf_src, cpu) == "none"
    assert resolve_quantization("auto", gguf_src, cpu, tp=2) == "none"
    assert resolve_quantization("none", gguf_src, cpu) == "none"
    with pytest.raises(ValueError, match="quantization 'gguf': the model is not a GGUF file"):
        resolve_quantization("gguf", hf_src, cpu)
    with pytest.raises(
        ValueError, match="quantization 'gguf': GGUF blocks are not split for tensor parallelism"
    ):
        resolve_quantization("gguf", gguf_src, cpu, tp=2)


@pytest.mark.slow
def test_smollm2_quantized_greedy_matches_transformers_on_the_same_gguf():
    """The default model with its Q4_1/Q8_0 blocks kept: HF's dequantized weights give the
    same greedy tokens (a differing token must be a near tie, as in tests/e2e/test_smollm2.py)."""
    from tests.e2e.oracle import assert_smollm2_chat_matches_hf
    from tests.e2e.utils import make_llm

    llm = make_llm(None, max_model_len=1024, quantization="gguf")
    try:
        model = llm.engine.client.engine_core.executor.worker.model
        assert {m.backend for m in model.modules() if isinstance(m, Linear)} == {"gguf"}
        assert_smollm2_chat_matches_hf(
            llm, ["What is the capital of France?", "Write a haiku about the sea."], 24
        )
    finally:
        llm.shutdown()


def test_weight_memory_is_the_gguf_size_when_quantized(tmp_path):
    """No dense copy beside the blocks: the model holds about the file's bytes."""
    from tokenbus.worker.worker import model_weight_bytes

    path = write_gguf(
        cached_tiny_model("llama", hidden_size=256, intermediate_size=512),
        tmp_path / "m.gguf",
        "Q4_1",
        with_tokenizer=False,
    )
    src = resolve_model(str(path))
    quantized = load_model(src, load_arch(src), torch.float32, "cpu", quantization="gguf")
    dense = load_model(src, load_arch(src), torch.float32, "cpu", quantization="none")
    size = path.stat().st_size
    assert 0.9 * size < model_weight_bytes(quantized) < 1.1 * size
    assert model_weight_bytes(dense) > 5 * size  # fp32: 4 bytes a value against Q4_1's 0.625
