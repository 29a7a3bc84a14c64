"""Every GGUF quant type in common use, per tensor as llama.cpp's recipes mix them: the block
kernels against the gguf package's numpy dequantizers, each type through a model, a Q4_K_M-like
mixed file against HF transformers (which dequantizes it with the same gguf.quants), and types
we do not run refused at load with the tensor named."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.e2e.oracle import assert_same_or_near_tie, hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import (
    GGUF_QTYPES,
    RANDOM_BLOCK_TYPES,
    random_k_quant_blocks,
    write_gguf,
)
from tests.fixtures.tiny_models import cached_tiny_model
from tests.model.test_quantized import _logits, kernels_for, rounded

from tokenbus import SamplingParams
from tokenbus.loader import iter_weights, load_arch, resolve_model
from tokenbus.loader.gguf_file import read_gguf
from tokenbus.loader.gguf_loader import HALF_QTYPES, KERNEL_QTYPES, QuantizedWeight
from tokenbus.model import native
from tokenbus.model.layers import Linear
from tokenbus.worker.model_builder import load_model

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the quantized kernels cannot be built here",
)
BLOCK_TYPES = [Q[name] for name in GGUF_QTYPES if name != "F32"]
# Shapes where no dimension is a round number of tiles: N not a multiple of 16, K = 896
# (Qwen2.5-0.5B's hidden size, which llama.cpp stores in 32-value types since 896 % 256 != 0).
SHAPES = {32: ((37, 896), (5, 96)), 256: ((37, 768), (5, 256))}  # block size -> (N, K)


def blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: gguf.quants' own quantization where it has one (Q8_0, Q4_*,
    Q5_*, MXFP4; F16 and BF16 rounded), else valid random blocks (K-quants, IQ4_NL, IQ4_XS:
    random quants, sane scales)."""
    if qtype.name in RANDOM_BLOCK_TYPES:
        return random_k_quant_blocks(qtype.name, rows, cols, seed)
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8).reshape(rows, -1)


def test_types_match_the_loader():
    """The kernel types here are the loader's, and gguf.quants quantizes every type the fixture
    does not build from random blocks (so each type has a real reference)."""
    assert set(BLOCK_TYPES) == set(KERNEL_QTYPES)
    assert set(HALF_QTYPES) == set(native.HALF_QTYPES)  # the model layers' own copy
    for qtype in BLOCK_TYPES:
        if qtype.name not in RANDOM_BLOCK_TYPES:
            gguf.quants.quantize(np.ones((1, 32), np.float32), qtype)


@pytest.mark.parametrize("cap", ["native", "avx512", "avx2", "baseline"])
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_kernels_equal_gguf_dequantize(qtype, cap):
    """dequant_rows gives gguf.quants' values exactly (every product of a block's scales and
    quants is exact in fp32); matmul gives dequantize-then-matmul within 1e-5 of the sum of
    |x * w| (fp32 sums in another order: ~sqrt(K) roundings of 6e-8), for M = 1, 3, 17, 64."""
    kernels = kernels_for(cap)
    block_size = max(32, gguf.GGML_QUANT_SIZES[qtype][0])  # the kernels take F16, BF16 by 32
    for rows, cols in SHAPES[block_size]:
        w = blocks(qtype, rows, cols, seed=rows)
        dense = torch.from_numpy(gguf.quants.dequantize(w, qtype).astype(np.float32))
        assert dense.isfinite().all() and dense.abs().max() > 0
        ids = torch.tensor([rows - 1, 0, 3, 3, rows // 2])
        got = kernels.dequant_rows(int(qtype), torch.from_numpy(w), cols, ids)
        assert torch.equal(got, dense[ids])
        for m in (1, 3, 17, 64):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            out = torch.full((m, rows + 3), float("nan"))[:, 1 : rows + 1]  # a column slice
            kernels.matmul(int(qtype), torch.from_numpy(w), cols, x, out)
            want = x.double() @ dense.double().T
            bound = 1e-5 * (x.double().abs() @ dense.double().abs().T) + 1e-30
            assert ((out.double() - want).abs() <= bound).all(), (qtype.name, cap, m)


@pytest.mark.parametrize(
    "qtype", [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4, Q.Q3_K, Q.Q6_K, Q.IQ4_XS], ids=lambda t: t.name
)
def test_shuffle_path_is_row_local_and_thread_count_free(qtype):
    """The types unpacked with byte shuffles (quant_matmul.c's 32-value sub-blocks): each
    output is one thread's sum over its row of W, for each row of x on its own, so the same
    bits whatever else is in the batch and however many threads share the call."""
    kernels = kernels_for("native")
    rows, cols = 45, 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 896
    w = torch.from_numpy(blocks(qtype, rows, cols, seed=1))
    x = torch.randn(17, cols, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads, m in ((1, 17), (2, 17), (3, 3)):
            torch.set_num_threads(threads)
            out = torch.empty(m, rows)
            kernels.matmul(int(qtype), w, cols, x[:m], out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0][:3], outs[2])


@pytest.mark.parametrize("cap", ["native", "avx512", "avx2"])
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_half_tiles_hold_the_file_s_values_and_take_x_as_fp32(qtype, cap):
    """F16 and BF16 matrices in 16-row tiles: the file's 2 bytes a value, every value back
    exactly (rows and the prefill GEMM's W^T); in the fp32 and integer modes a call equals
    x @ W^T in fp32 (none rounds x for these weights), at any number of rows (fp32 too, which
    takes 64 at most on the block types' tiles), and in bf16 mode (where a bf16 engine runs it)
    x @ W^T with both rounded to bf16; each row's result is the same bits whatever else shares
    its call."""
    kernels = kernels_for(cap)
    assert kernels.tiles(int(qtype)) and kernels.tile_format(int(qtype)) == int(qtype)
    rows, cols = 37, 896  # a partial last tile
    w = torch.from_numpy(blocks(qtype, rows, cols, seed=3))
    dense = torch.from_numpy(gguf.quants.dequantize(w.numpy(), qtype).astype(np.float32))
    tiles = kernels.repack_tiles(int(qtype), w, cols)
    assert tiles.numel() == 3 * 16 * cols * 2
    ids = torch.tensor([rows - 1, 0, 17, 17])
    assert torch.equal(kernels.tile_dequant_rows(int(qtype), tiles, rows, cols, ids), dense[ids])
    weight_t = torch.full((cols, 3 * 16 + 4), float("nan"))[:, 1:-3]  # row-strided
    kernels.tile_dequant_t(int(qtype), tiles, rows, cols, 0, weight_t)
    assert torch.equal(weight_t[:, :rows], dense.T) and not weight_t[:, rows:].any()
    x = torch.randn(150, cols, generator=torch.Generator().manual_seed(0))
    bf16 = x.bfloat16().double(), dense.bfloat16().double()
    references = {"fp32": (x.double(), dense.double()), "bf16": bf16}
    first = {}
    for mode in (
        ["fp32", "int8", "int16"] + ["q8_k"] * kernels.q8_k + ["bf16"] * bool(kernels.bf16_engine)
    ):
        xr, wr = references.get(mode, references["fp32"])
        want, bound = xr @ wr.T, 1e-5 * (xr.abs() @ wr.abs().T)
        for m in (1, 5, 64, 150):
            out = torch.full((m, rows + 3), float("nan"))[:, 1 : rows + 1]  # a column slice
            kernels.tile_matmul(int(qtype), tiles, rows, cols, x[:m], out, mode)
            assert ((out.double() - want[:m]).abs() <= bound[:m]).all(), (mode, m)
            kind = "bf16" if mode == "bf16" else "fp32"  # every other mode is fp32's
            first.setdefault(kind, out)
            assert torch.equal(out[:1], first[kind][:1]), (mode, m)


@pytest.mark.parametrize("cap", ["native", "avx512", "avx2"])
@pytest.mark.parametrize("tiles", [13, 14])
def test_half_tiles_give_the_same_bits_however_the_threads_split_them(tiles, cap):
    """AVX-512 runs half tiles in groups of 3 (AVX2 one by one), and a decode-sized call (up to
    4 rows) one by one where groups of 3 would leave a thread fewer than 4: 13 and 14 tiles on
    one thread end in a group of 1 and of 2, at 1 row on 2 and 3 threads go one by one, at 6
    rows stay in groups. Every split gives x @ W^T in fp32, and the same bits."""
    kernels = kernels_for(cap)
    rows, cols = 16 * tiles - 5, 128
    w = torch.from_numpy(blocks(Q.F16, rows, cols, seed=tiles))
    dense = torch.from_numpy(gguf.quants.dequantize(w.numpy(), Q.F16).astype(np.float32)).double()
    packed = kernels.repack_tiles(int(Q.F16), w, cols)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(tiles))
    want, bound = x.double() @ dense.T, 1e-5 * (x.double().abs() @ dense.abs().T)
    before = torch.get_num_threads()
    try:
        for m in (1, 6):
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                out = torch.empty(m, rows)
                kernels.tile_matmul(int(Q.F16), packed, rows, cols, x[:m], out, "fp32")
                outs.append(out)
            assert ((outs[0].double() - want[:m]).abs() <= bound[:m]).all(), m
            assert all(torch.equal(out, outs[0]) for out in outs[1:]), m
    finally:
        torch.set_num_threads(before)


def mxfp4_blocks(rows: int, cols: int, exponents: np.ndarray) -> np.ndarray:
    """uint8 [rows, row bytes] of MXFP4 blocks: random nibbles, block j of row r with E8M0 byte
    exponents[(j + r) % len(exponents)]."""
    num_blocks = cols // 32
    w = np.random.default_rng(rows).integers(0, 256, size=(rows, num_blocks, 17), dtype=np.uint8)
    w[:, :, 0] = exponents[
        (np.arange(num_blocks)[None, :] + np.arange(rows)[:, None]) % len(exponents)
    ]
    return w.reshape(rows, -1)


@pytest.mark.parametrize("cap", ["native", "avx512", "avx2", "baseline"])
def test_mxfp4_scales_are_exact_at_every_exponent(cap):
    """MXFP4's scale 2^(e - 128) for each of the 256 E8M0 bytes e, in GGUF rows and in tiles:
    the subnormal ones (e = 0, 1, as ggml and gguf make them), those fp16 could not hold (e
    below 104 or above 143) and the values past fp32's range (inf, as in gguf) all dequantize
    to gguf's values exactly. Over scales from 2^-68 to 2^68, the matmuls (rows; tiles with
    fp32, int8 and int16 activations) equal dequantize-then-matmul within 1e-5 of sum |x * w|,
    on x rounded as each rounds it."""
    kernels = kernels_for(cap)
    rows, cols = 17, 256 * 32  # a partial second tile; every e in every row
    w = mxfp4_blocks(rows, cols, np.arange(256, dtype=np.uint8))
    with np.errstate(over="ignore"):  # e >= 253: 12 * 2^125 is past fp32's range
        dense = torch.from_numpy(gguf.quants.dequantize(w, Q.MXFP4).astype(np.float32))
    assert (
        dense.isinf().any()
        and (dense.abs() < torch.finfo(torch.float32).tiny).logical_and(dense != 0).any()
    )
    ids = torch.arange(rows)
    assert torch.equal(kernels.dequant_rows(int(Q.MXFP4), torch.from_numpy(w), cols, ids), dense)
    tiled = kernels.tiles(int(Q.MXFP4))
    if tiled:
        tiles = kernels.repack_tiles(int(Q.MXFP4), torch.from_numpy(w), cols)
        assert tiles.numel() == 2 * 16 * w.shape[1]  # the file's 17 bytes per 32 values
        assert torch.equal(kernels.tile_dequant_rows(int(Q.MXFP4), tiles, rows, cols, ids), dense)
        weight_t = torch.empty(cols, 32)
        kernels.tile_dequant_t(int(Q.MXFP4), tiles, rows, cols, 0, weight_t)
        assert torch.equal(weight_t[:, :rows], dense.T)

    cols = 1024
    w = torch.from_numpy(mxfp4_blocks(rows, cols, np.arange(60, 197, 4, dtype=np.uint8)))
    dense = torch.from_numpy(gguf.quants.dequantize(w.numpy(), Q.MXFP4).astype(np.float32))
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
    tiles = kernels.repack_tiles(int(Q.MXFP4), w, cols) if tiled else None
    for mode, levels in (("rows", 0), ("fp32", 0), ("int8", 127), ("int16", 32767)):
        if mode != "rows" and not tiled:
            continue
        out = torch.empty(5, rows)
        if mode == "rows":
            kernels.matmul(int(Q.MXFP4), w, cols, x, out)
        else:
            kernels.tile_matmul(int(Q.MXFP4), tiles, rows, cols, x, out, mode)
        xr = (rounded(x, levels) if levels else x).double()
        want = xr @ dense.double().T
        bound = 1e-5 * (xr.abs() @ dense.double().abs().T)
        assert ((out.double() - want).abs() <= bound).all(), (cap, mode)


@pytest.mark.parametrize("qtype", GGUF_QTYPES)
def test_each_type_loads_and_runs_as_its_dequantized_model(tmp_path, qtype):
    """A model whose matrices are all of one type (embedding and LM head too): block and half
    types are kept as the file holds them and run by the kernels, F32 copied; either way the
    logits equal those of the model dequantized by gguf.quants on load."""
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512, vocab_size=2048)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    weights = dict(iter_weights(src, load_arch(src), keep_quantized=True))
    embedding = weights["model.embed_tokens.weight"]
    assert isinstance(embedding, QuantizedWeight) == (Q[qtype] in KERNEL_QTYPES)
    quantized, model = _logits(src, "gguf")
    if Q[qtype] in KERNEL_QTYPES:
        assert {m.backend for m in model.modules() if isinstance(m, Linear)} == {"gguf"}
        assert model.embed_quantized is not None
    dequantized, _ = _logits(src, "none")
    error = ((quantized - dequantized).norm() / dequantized.norm()).item()
    assert error < 1e-4  # int16 activations on tiled types (Q8_0, Q4_*), fp32 on the rest


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_half_file_runs_on_its_16_bit_floats_or_rounds_to_q8_0(tmp_path, qtype):
    """An F16 or BF16 file's matrices stay as the file holds them, 2 bytes a weight (in tiles
    where the CPU has them, a decode step's layers in C), not an fp32 copy of 4; --quantization
    q8_0 rounds them to Q8_0, as it does a safetensors file's."""
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512, vocab_size=2048)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    half = load_model(src, load_arch(src), torch.float32, "cpu", quantization="gguf")
    weights = [w for m in gguf_linears(half) for w in m.quantized_weights()]
    weights.append(half.embed_quantized)
    assert {w.qtype for w in weights} == {int(Q[qtype])}
    assert sum(w.data.numel() for w in weights) == 2 * sum(w.rows * w.cols for w in weights)
    assert all(m.weight.numel() == 0 for m in gguf_linears(half))
    assert half.decodes_in_c == half.quant_kernels.tiles(int(Q[qtype]))
    q8_0 = load_model(src, load_arch(src), torch.float32, "cpu", quantization="q8_0")
    rounded_ = [w for m in gguf_linears(q8_0) for w in m.quantized_weights()]
    assert {w.qtype for w in [*rounded_, q8_0.embed_quantized]} == {int(Q.Q8_0)}


# llama.cpp's Q4_K_M recipe on a model whose rows fit K-quants: Q4_K, with Q6_K for the output
# and attn_v / ffn_down of some layers. Layer 1 takes the types the recipes fall back to (Q5_0,
# Q5_1, IQ4_NL, Q8_0 where a row is not a multiple of 256) and those of Q3_K_M and imatrix
# quants (Q3_K, IQ4_XS), so one fused linear mixes per-row types and tiled ones.
MIXED_RECIPE = {
    "token_embd": "Q5_0",
    "output": "Q6_K",
    "blk.0.attn_v": "Q6_K",
    "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_q": "Q3_K",
    "blk.1.attn_k": "IQ4_XS",
    "blk.1.attn_v": "Q8_0",
    "blk.1.attn_output": "IQ4_NL",
    "blk.1.ffn_gate": "Q5_1",
    "blk.1.ffn_up": "Q5_K",
    "blk.1.ffn_down": "Q5_0",
}


def mixed_qtype(gguf_name: str) -> str:
    return MIXED_RECIPE.get(gguf_name.removesuffix(".weight"), "Q4_K")


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    return write_gguf(hf_dir, tmp_path_factory.mktemp("mixed") / "q4_k_m.gguf", mixed_qtype)


def gguf_linears(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("quant_activations", ["fp32", "auto"])
def test_mixed_type_gguf_greedy_matches_transformers(mixed_gguf, quant_activations):
    """HF transformers loads the same file through gguf.quants' dequantizers, so the only
    difference left is our kernels (K/V kept in fp32: auto would store fp16 for a GGUF model).
    With fp32 activations the greedy tokens are HF's and so are their logprobs, to 1e-4; under
    auto (int16; from 32 rows bf16 where the CPU has a bf16 engine, and from 16 q8_k on the
    K-quant shards where it has AVX-512 VNNI without AMX) a first difference is allowed at a
    near tie: within 0.1 nats, or 0.5 where the 40-token prefills' K-quant calls round x to
    int8 per 256 values (this random model's logits then move further: test_q8k_tiles.py)."""
    types = {info.qtype.name for info in read_gguf(mixed_gguf).tensors.values()}
    assert types == {*MIXED_RECIPE.values(), "Q4_K", "F32"}
    hf = load_hf(str(mixed_gguf.parent), mixed_gguf.name)
    prompts = random_prompts(4, 3, 40, seed=3)
    llm = make_llm(
        mixed_gguf, dtype="float32", kv_cache_dtype="float32", quant_activations=quant_activations
    )
    try:
        model = llm.engine.client.engine_core.executor.worker.model
        assert {m.backend for m in gguf_linears(model)} == {"gguf"}
        params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, prompt in zip(outputs, prompts):
            got, want = out.outputs[0], hf_greedy(hf, prompt, 16)
            if quant_activations != "fp32":
                q8_k = any(m.kernel.modes.k_quant_from_rows for m in gguf_linears(model))
                assert_same_or_near_tie(got.token_ids, want, got.logprobs, 0.5 if q8_k else 0.1)
                continue
            assert got.token_ids == want
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
            hf_logprobs = logits.float().log_softmax(-1).gather(1, torch.tensor(want)[:, None])
            ours = torch.tensor([lp[t].logprob for t, lp in zip(want, got.logprobs)])
            torch.testing.assert_close(ours, hf_logprobs.squeeze(1), rtol=0, atol=1e-4)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "qtype",
    [Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0, Q.Q8_1],
    ids=lambda t: t.name,
)
def test_unsupported_types_are_refused_with_the_tensor_named(tmp_path, qtype):
    hf_dir = cached_tiny_model("llama", hidden_size=256, intermediate_size=512, vocab_size=1024)
    target = "blk.1.ffn_up.weight"
    path = write_gguf(
        hf_dir,
        tmp_path / "m.gguf",
        lambda name: qtype.name if name == target else "Q8_0",
        with_tokenizer=False,
    )
    with pytest.raises(ValueError, match=f"tensor {target} has unsupported type {qtype.name}"):
        load_arch(resolve_model(str(path)))  # the metadata read that starts every load


def test_unsupported_type_refused_by_llm_before_the_engine_starts(tmp_path):
    path = write_gguf(
        cached_tiny_model("llama"),
        tmp_path / "m.gguf",
        lambda name: "Q8_1" if name == "blk.0.attn_k.weight" else "Q8_0",
    )
    with pytest.raises(ValueError, match="tensor blk.0.attn_k.weight has unsupported type Q8_1"):
        make_llm(path)


def test_unknown_type_id_is_refused_with_the_tensor_named(tmp_path):
    """A type id newer than the installed gguf package (patched into a valid file's header)."""
    path = write_gguf(cached_tiny_model("llama"), tmp_path / "m.gguf", "Q8_0", with_tokenizer=False)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_k.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    num_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * num_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == Q.Q8_0
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor blk.0.attn_k.weight has GGML type id 250"):
        load_arch(resolve_model(str(path)))
