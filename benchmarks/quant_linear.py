"""The quantized block kernels against oneDNN's packed fp32 linear at SmolLM2's shapes, and the
dequantize + GEMM path, per activation row count; and dequantizing into a fresh tensor vs a
reused one (2 threads). --step: a whole decode step's linears (30 layers + the LM head, distinct
weights, so they stream from memory as in a real step) per row count, on GGUF rows and on 16-row
tiles with fp32, int16, int8 and (AVX512-BF16: AMX or dot products) bf16 activations, against
dequantize + GEMM.

    .venv/bin/python benchmarks/quant_linear.py [--step]
    .venv/bin/python benchmarks/quant_linear.py --step --rows 1 16 --kernels int16 --repeats 15

--rows, --kernels (rows, dequantize+GEMM, fp32, int8, int16, bf16) and --repeats (the best of
that many timings) narrow --step to the cells a comparison needs, so two builds can be timed
in turn.

--against-bf16-gemm (AVX512-BF16 CPUs): our bf16 tiles on Q4_1 blocks against torch's bf16
F.linear on dense bf16 weights (oneDNN: what vLLM's CPU build runs in bf16), in GFLOP/s, per
layer shape and row count: how near a compute-bound prefill chunk is to that peer's GEMM.

--baseline REV (with --step): the same cells also on the tile kernels of git revision REV
(its quant_tiles.c and headers), the two builds taking turns in one process, each cell the best
of --repeats rounds: a kernel change against the build before it on a noisy machine (REV's
tile_* entry points must take today's arguments).

    .venv/bin/python benchmarks/quant_linear.py --step --rows 1 64 --kernels int16 --repeats 10 \
      --baseline main

--threads N [N ...] (with --step): the tile cells at each thread count, in turns (1 2: what a
second core adds to a kernel); the other cells stay at 2 threads.

--peak (AVX2 builds): one thread of the int16 and int8 tile kernels at 64 rows in multiply-adds
a second, against the rate the core issues vpmaddwd + vpaddd at (madd_peak.c): how much a
compute-bound prefill chunk could still gain without VNNI. Also oneDNN's fp32 linear (an fp32
GEMM peer's prefill) against the core's FMA rate, and the two issue rates' ratio: the most the
int16 tiles can lead that peer by where both are compute-bound. Where the CPU itself has AVX-512
(the cap aside), the same rates at 512 bits: FMA, vpmaddwd + vpaddd, and VNNI's vpdpwssd.

    TOKENBUS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
      MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python benchmarks/quant_linear.py --peak

    .venv/bin/python benchmarks/quant_linear.py --against-bf16-gemm

--half: F16 and BF16 matrices in tiles (x as fp32, any number of rows) against dequantize + GEMM
and against oneDNN's fp32 linear on a dense copy (what an F16 file's model held before), in
GFLOP/s per row count: whether the tiles should take prefill-sized calls too.

    .venv/bin/python benchmarks/quant_linear.py --half --repeats 5

--types: one decode-shaped matmul (1 row, int16 activations, 2 threads) on a 65536 x 2048 matrix
of each tiled GGUF type (random blocks, ~40-140 MB: past the caches, as a decode step's weights
are), the types taking turns, each the best of --repeats rounds: the time, and the GGUF file's
bytes streamed per second against Q4_0's ("per byte": how much slower a type is per byte of
the file than Q4_0).

    .venv/bin/python benchmarks/quant_linear.py --types --repeats 10 --record benchmarks/results
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from revisions import REPO, load_at_revision  # benchmarks/ is sys.path[0] when run as a script
from tokenbus.bench.record import make_record, record_dir, this_command, write_record
from tokenbus.model.layers.linear import make_linear_kernel
from tokenbus.model.layers.quantized import DequantBuffer
from tokenbus.model.native import (
    QUANT_MAX_ROWS,
    TILE_ACTIVATIONS,
    build_shared_object,
    load_quant_kernels,
)
from tokenbus.utils.cpu import CpuFeatures

TILE_SOURCE = REPO / "src/tokenbus/model/native/quant_tiles.c"
SHAPES = [
    (3072, 576, Q.Q4_1),
    (576, 1536, Q.Q4_1),
    (49152, 576, Q.Q8_0),
]  # gate_up, down, tied LM head


TYPE_SHAPE = (65536, 2048)
TILED_TYPES = (
    *(Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4),
    *(Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS),
)


def type_blocks(qtype: Q, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks of `qtype`: quantized random weights where gguf.quants can, else random valid
    blocks (the tests' generator)."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4):
        data = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        return torch.from_numpy(quantize(data, qtype))
    sys.path.insert(0, str(REPO))
    from tests.fixtures.tiny_gguf import random_k_quant_blocks

    return torch.from_numpy(random_k_quant_blocks(qtype.name, rows, cols))


def tile_types(kernels, repeats: int) -> dict[str, dict[str, float]]:
    """Per tiled type: ms of one decode matmul, GB/s of the file's bytes, per byte vs Q4_0."""
    rows, cols = TYPE_SHAPE
    x, out = torch.randn(1, cols), torch.empty(1, rows)
    weights, cells = {}, {}
    for qtype in TILED_TYPES:
        blocks = type_blocks(qtype, rows, cols)
        tiles = kernels.repack_tiles(int(qtype), blocks, cols)
        fmt = kernels.tile_format(int(qtype))
        weights[qtype.name] = (blocks.numel(), tiles)

        def cell(fmt=fmt, tiles=tiles) -> float:
            start = time.perf_counter()
            kernels.tile_matmul(fmt, tiles, rows, cols, x, out, "int16")
            return time.perf_counter() - start

        cells[qtype.name] = cell
    best = best_of_rounds(cells, repeats)
    q4_rate = weights["Q4_0"][0] / best["Q4_0"]
    table = {}
    for name, seconds in best.items():
        file_bytes, tiles = weights[name]
        rate = file_bytes / seconds
        table[name] = {
            "ms": round(seconds * 1e3, 3),
            "file GB/s": round(rate / 1e9, 1),
            "tile bytes / file bytes": round(tiles.numel() / file_bytes, 2),
            "per byte vs Q4_0": round(q4_rate / rate, 2),
        }
        print(name, table[name])
    return table


HALF_SHAPE = (8192, 2048)  # Llama-3.2-1B's MLP up projection
HALF_ROWS = (1, 4, 16, 64, 256, 512)


def half_tiles(kernels, repeats: int) -> dict[str, dict[str, float]]:
    """F16 and BF16 tiles (x as fp32 at any number of rows) against the two other ways to run
    such a matrix: dequantize + fp32 GEMM per call, and oneDNN's fp32 linear on a dense copy
    packed once (twice the memory: what the model held before half tiles). GFLOP/s per row
    count, each cell the best of `repeats` rounds taken in turns."""
    from tokenbus.model.layers.quantized import KernelWeight, shard_matmul

    rows, cols = HALF_SHAPE
    dense_w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    onednn = make_linear_kernel(dense_w, None, "onednn")
    buffer = DequantBuffer()
    table = {}
    for qtype in (Q.F16, Q.BF16):
        half = dense_w.to(torch.float16 if qtype == Q.F16 else torch.bfloat16)
        blocks = half.view(torch.uint8).reshape(rows, -1).contiguous()
        tiles = kernels.repack_tiles(int(qtype), blocks, cols)
        weight = KernelWeight(int(qtype), tiles, cols, rows, tiled=True)

        def dequantized_gemm(x, out, qtype=qtype, tiles=tiles) -> None:
            weight_t = buffer.take(cols, tiles.shape[0] * 16)  # W^T, whole tiles
            kernels.tile_dequant_t(int(qtype), tiles, rows, cols, 0, weight_t)
            torch.mm(x, weight_t[:, :rows], out=out)

        for m in HALF_ROWS:
            x, out = torch.randn(m, cols), torch.empty(m, rows)

            def timed(fn) -> float:
                start = time.perf_counter()
                fn()
                return time.perf_counter() - start

            cells = {
                "tiles": lambda: timed(
                    lambda: shard_matmul(kernels, weight, x, out, "fp32", buffer)
                ),
                "dequantize+GEMM": lambda: timed(lambda: dequantized_gemm(x, out)),
                "oneDNN fp32": lambda: timed(lambda: onednn(x)),
            }
            for cell in cells.values():  # warm: buffers, oneDNN's primitive
                cell()
            best = best_of_rounds(cells, repeats)
            flops = 2 * m * rows * cols
            row = {f"{name} GFLOP/s": round(flops / t / 1e9, 1) for name, t in best.items()}
            row["tiles / oneDNN fp32"] = round(best["oneDNN fp32"] / best["tiles"], 2)
            table[f"{qtype.name} rows={m}"] = row
            print(f"{qtype.name} {rows}x{cols} rows={m}: {row}")
    return table


def per_call(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def best_of_rounds(cells: dict, rounds: int) -> dict[str, float]:
    """name -> the least of `rounds` timings of cells[name]() (each returns one), the cells taking
    turns round by round, so that a slow spell of the machine slows every cell alike."""
    best = {name: float("inf") for name in cells}
    for _ in range(rounds):
        for name, cell in cells.items():
            best[name] = min(best[name], cell())
    return best


STEP_ROWS = (1, 4, 8, 16, 32, 64, 256)
STEP_KERNELS = ("rows", "dequantize+GEMM", *TILE_ACTIVATIONS)


def step_linears(
    kernels,
    row_counts=STEP_ROWS,
    names=STEP_KERNELS,
    repeats: int = 1,
    baseline: tuple[str, object] | None = None,
    threads: tuple[int, ...] = (2,),
) -> None:
    """SmolLM2-135M's decode step: per layer qkv 960x576, o 576x576, gate_up 3072x576, down
    576x1536 (Q4_1), then the tied Q8_0 LM head 49152x576. `baseline`: (name, kernels) whose
    tile kernels take turns with these, round by round. `threads`: the tile cells once per
    thread count, also in turns (how far a second thread speeds a kernel up)."""
    rng = np.random.default_rng(0)
    shapes = [(960, 576, Q.Q4_1), (576, 576, Q.Q4_1), (3072, 576, Q.Q4_1), (576, 1536, Q.Q4_1)] * 30
    shapes.append((49152, 576, Q.Q8_0))
    base = {
        shape: torch.from_numpy(
            quantize(rng.standard_normal(shape[:2]).astype(np.float32), shape[2])
        )
        for shape in set(shapes)
    }
    rows_layout = [
        (int(q), base[(n, k, q)].clone(), n, k) for n, k, q in shapes
    ]  # a copy per layer
    builds = [("", kernels)] + ([baseline] if baseline else [])
    tiled = {
        name: [(q, build.repack_tiles(q, w, k), n, k) for q, w, n, k in rows_layout]
        for name, build in builds
    }
    buffer = DequantBuffer()
    modes = [
        mode
        for mode in TILE_ACTIVATIONS
        if mode in names and (mode != "bf16" or kernels.bf16_engine)
    ]
    for m in row_counts:
        x = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
        outs = [torch.empty(m, n) for _, _, n, _ in rows_layout]

        def once(weights, fn) -> float:  # ms for all of a step's linears
            return (
                per_call(
                    lambda: [fn(q, w, n, k, o) for (q, w, n, k), o in zip(weights, outs)],
                    5 if m > 16 else 20,
                )
                * 1e3
            )

        cells = {}  # name -> one timing
        if m <= QUANT_MAX_ROWS and "rows" in names:
            cells["rows"] = lambda: once(
                rows_layout, lambda q, w, n, k, o: kernels.matmul(q, w, k, x[k], o)
            )
        if "dequantize+GEMM" in names:
            cells["dequantize+GEMM"] = lambda: once(
                rows_layout,
                lambda q, w, n, k, o: o.copy_(
                    x[k] @ kernels.dequant_rows(q, w, k, torch.arange(n), out=buffer.take(n, k)).T
                ),
            )
        for mode in modes if m <= QUANT_MAX_ROWS else [mode for mode in modes if mode != "fp32"]:
            for name, build in builds:
                for count in threads:
                    label = ", ".join(
                        ([name] if name else []) + ([f"{count} threads"] if threads != (2,) else [])
                    )
                    cells[f"tiles {mode}" + (f" ({label})" if label else "")] = (
                        lambda build=build, weights=tiled[name], mode=mode, count=count: (
                            with_threads(
                                count,
                                lambda: once(
                                    weights,
                                    lambda q, w, n, k, o: build.tile_matmul(
                                        q, w, n, k, x[k], o, mode
                                    ),
                                ),
                            )
                        )
                    )
        times = best_of_rounds(cells, repeats)
        print(
            f"step linears, {m} rows: "
            + ", ".join(f"{name} {t:.2f} ms" for name, t in times.items())
        )


def with_threads(count: int, fn):
    """fn() with torch (and so every kernel call, which passes torch's count on) at `count`
    threads; the count before is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def baseline_kernels(rev: str):
    """(rev, the quantized kernels with git revision `rev`'s tile kernels)."""
    return rev, load_at_revision(
        rev, TILE_SOURCE, lambda path: load_quant_kernels(tile_source=path)
    )


def against_bf16_gemm(kernels, row_counts=(16, 64, 256, 512), repeats: int = 5) -> None:
    """tiles bf16 (Q4_1, packed to bf16 per call) vs F.linear in bf16 on dense bf16 weights."""
    rng = np.random.default_rng(0)
    for n, k in ((960, 576), (3072, 576), (576, 1536)):
        dense = rng.standard_normal((n, k)).astype(np.float32)
        tiles = kernels.repack_tiles(int(Q.Q4_1), torch.from_numpy(quantize(dense, Q.Q4_1)), k)
        weight = torch.from_numpy(dense).to(torch.bfloat16)
        for m in row_counts:
            x, out = torch.randn(m, k), torch.empty(m, n)
            xb = x.to(torch.bfloat16)
            ours = min(
                per_call(lambda: kernels.tile_matmul(int(Q.Q4_1), tiles, n, k, x, out, "bf16"), 20)
                for _ in range(repeats)
            )
            peer = min(per_call(lambda: F.linear(xb, weight), 20) for _ in range(repeats))
            flop = 2 * m * n * k
            print(
                f"{n}x{k} rows={m}: "
                f"tiles bf16 {ours * 1e3:.3f} ms ({flop / ours / 1e9:.0f} GFLOP/s), "
                f"torch bf16 F.linear {peer * 1e3:.3f} ms ({flop / peer / 1e9:.0f} GFLOP/s), "
                f"ours / torch {peer / ours:.2f}x"
            )


PEAK_STEPS = 20_000_000  # x 8 vpmaddwd: ~0.05 s a timing at ~3 G a second


def peak(kernels, rows: int = 64, rounds: int = 20) -> dict:
    """One thread: the int16 and int8 tile kernels (Q4_1, SmolLM2's gate_up and down shapes, 64
    rows) in multiply-adds a second, against the rate this core issues the int16 kernel's
    instructions at (benchmarks/madd_peak.c: 8 chains of vpmaddwd + vpaddd on registers); oneDNN's
    fp32 linear on the same shapes against the core's vfmadd231ps rate (8 chains). Timings
    alternate, the best of `rounds` each, so a noisy machine slows them alike."""
    cpu = CpuFeatures.detect()
    # oneDNN and MKL read their own caps: without them, on an AVX-512 CPU the fp32 linear would run
    # zmm code and be weighed against the ymm FMA rate.
    capped = (
        os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2"
        and os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").upper() == "AVX2"
    )
    if kernels.isa != "avx2" or cpu.has("avx_vnni") or not capped:
        raise SystemExit(
            f"--peak measures AVX2 code without VNNI (vpmaddwd, ymm FMA); these kernels are "
            f"{cpu.describe()}: set TOKENBUS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 "
            "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
        )
    lib = ctypes.CDLL(str(build_shared_object(Path(__file__).with_name("madd_peak.c"), cpu)))
    for chains in (lib.int16_madd_chains, lib.fp32_fma_chains):
        chains.argtypes = [ctypes.c_int64]
        assert chains(1) == 0
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    cases = []
    for n, k in ((3072, 576), (576, 1536)):
        dense = rng.standard_normal((n, k)).astype(np.float32)
        tiles = kernels.repack_tiles(int(Q.Q4_1), torch.from_numpy(quantize(dense, Q.Q4_1)), k)
        x, out = torch.randn(rows, k), torch.empty(rows, n)
        for mode in ("int16", "int8"):
            cases.append(
                (
                    f"tiles {mode} {n}x{k}",
                    rows * n * k,
                    lambda tiles=tiles, n=n, k=k, x=x, out=out, mode=mode: kernels.tile_matmul(
                        int(Q.Q4_1), tiles, n, k, x, out, mode
                    ),
                )
            )
        onednn = make_linear_kernel(torch.from_numpy(dense), None, "onednn")
        cases.append((f"oneDNN fp32 {n}x{k}", rows * n * k, lambda onednn=onednn, x=x: onednn(x)))
    cases.append(
        ("vpmaddwd + vpaddd chains", PEAK_STEPS * 8 * 16, lambda: lib.int16_madd_chains(PEAK_STEPS))
    )
    cases.append(
        ("vfmadd231ps chains", PEAK_STEPS * 8 * 8, lambda: lib.fp32_fma_chains(PEAK_STEPS))
    )
    best = best_of_rounds({name: lambda fn=fn: per_call(fn, 3) for name, _, fn in cases}, rounds)
    rate = {name: macs / best[name] / 1e9 for name, macs, _ in cases}
    int16_rate, fma_rate = rate["vpmaddwd + vpaddd chains"], rate["vfmadd231ps chains"]
    print(
        f"one thread, {rows} rows: int16 multiply-add issue rate {int16_rate:.1f} G/s "
        f"(int8 can pass it: a vpmaddubsw takes 32 products); fp32 FMA rate {fma_rate:.1f} G/s; "
        f"their ratio {int16_rate / fma_rate:.2f}: the most int16 tiles can lead an fp32 GEMM "
        "where both are compute-bound"
    )
    for name, _, _ in cases[:-2]:
        ceiling = fma_rate if name.startswith("oneDNN") else int16_rate
        print(
            f"{name}: {rate[name]:.1f} G multiply-adds/s, {rate[name] / ceiling:.0%} of the "
            f"{'FMA' if name.startswith('oneDNN') else 'int16'} rate"
        )
    for n, k in ((3072, 576), (576, 1536)):
        ratio = rate[f"tiles int16 {n}x{k}"] / rate[f"oneDNN fp32 {n}x{k}"]
        print(f"{n}x{k}: int16 tiles / oneDNN fp32 {ratio:.2f}x")
    row = {
        "vpmaddwd + vpaddd": round(int16_rate, 1),
        "FMA": round(fma_rate, 1),
        "integer / FMA rate": round(int16_rate / fma_rate, 2),
    }
    for n, k in ((3072, 576), (576, 1536)):
        tiles, onednn = rate[f"tiles int16 {n}x{k}"], rate[f"oneDNN fp32 {n}x{k}"]
        row[f"int16 tiles {n}x{k}"] = f"{tiles:.1f} ({tiles / int16_rate:.0%})".replace("%", " %")
        row[f"oneDNN fp32 {n}x{k}"] = f"{onednn:.1f} ({onednn / fma_rate:.0%})".replace("%", " %")
        row[f"int16 / oneDNN {n}x{k}"] = round(tiles / onednn, 2)
    figures = {f"one thread, {rows} rows, 256-bit chains": row}
    zmm = zmm_rates(lib, rounds)
    if zmm:  # the CPU's own 512-bit rates, each beside the zmm FMA
        cells = {"FMA": round(zmm["vfmadd231ps"], 1)}
        for name, ratio in (("vpmaddwd + vpaddd", "integer / FMA rate"), ("vpdpwssd", None)):
            if name in zmm:
                cells[name] = round(zmm[name], 1)
                cells[ratio or f"{name} / FMA"] = round(zmm[name] / zmm["vfmadd231ps"], 2)
        figures["512-bit chains (the CPU uncapped)"] = cells
    return figures


def zmm_rates(lib, rounds: int) -> dict[str, float]:
    """The same issue rates at 512 bits, where the CPU itself has AVX-512 (whatever the cap): the
    int16 kernel's AVX-512 instructions without VNNI and with it, against the zmm FMA."""
    chains = {
        "vfmadd231ps": (lib.zmm_fma_chains, 16),
        "vpmaddwd + vpaddd": (lib.zmm_madd_chains, 32),
        "vpdpwssd": (lib.zmm_vnni_chains, 32),
    }
    for fn, _ in chains.values():
        fn.argtypes = [ctypes.c_int64]
    chains = {name: (fn, lanes) for name, (fn, lanes) in chains.items() if fn(1) == 0}
    if "vfmadd231ps" not in chains:
        return {}
    best = best_of_rounds(
        {
            name: lambda fn=fn: per_call(lambda: fn(PEAK_STEPS // 2), 3)
            for name, (fn, _) in chains.items()
        },
        rounds,
    )
    rate = {
        name: PEAK_STEPS // 2 * 8 * lanes / best[name] / 1e9 for name, (_, lanes) in chains.items()
    }
    print(
        "zmm (this CPU, uncapped): "
        + ", ".join(
            f"{name} {rate[name]:.1f} G/s ({rate[name] / rate['vfmadd231ps']:.2f}x the FMA)"
            for name in chains
        )
    )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", action="store_true", help="a whole decode step's linears instead")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=STEP_ROWS, help="--step: activation row counts"
    )
    parser.add_argument(
        "--kernels", nargs="+", default=STEP_KERNELS, choices=STEP_KERNELS, help="--step: which"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="--step: the best of this many timings"
    )
    parser.add_argument(
        "--baseline", metavar="REV", help="--step: also git revision REV's tile kernels, in turns"
    )
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[2], help="--step: tile cells per thread count"
    )
    parser.add_argument(
        "--against-bf16-gemm", action="store_true", help="bf16 tiles vs torch's bf16 GEMM"
    )
    parser.add_argument(
        "--peak", action="store_true", help="integer tiles against the core's int16 issue rate"
    )
    parser.add_argument(
        "--types", action="store_true", help="a decode matmul per tiled GGUF type, per byte"
    )
    parser.add_argument(
        "--half", action="store_true", help="F16 and BF16 tiles vs dequantize+GEMM and oneDNN fp32"
    )
    parser.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="--peak, --types, --half: write a run record under DIR/int16_peak/, DIR/tile_types/ "
        "or DIR/half_tiles/",
    )
    args = parser.parse_args()
    if args.baseline and not args.step:
        parser.error("--baseline compares --step's cells")
    if args.threads != [2] and not args.step:
        parser.error("--threads sets --step's tile cells")
    torch.set_num_threads(2)
    print(f"CPU: {CpuFeatures.detect().describe()}")
    kernels = load_quant_kernels()
    if args.against_bf16_gemm:
        if not kernels.bf16_engine:
            raise SystemExit("--against-bf16-gemm needs AVX512-BF16 (this CPU has no bf16 engine)")
        against_bf16_gemm(kernels)
        return
    if args.types:
        rows = tile_types(kernels, args.repeats)
        if record_dir(args.record):
            units = {"ms": "ms", "file GB/s": "GB/s", "per byte vs Q4_0": "×"}
            record = make_record("tile_types", this_command(), rows, units=units)
            write_record(record_dir(args.record), record)
        return
    if args.half:
        rows = half_tiles(kernels, max(args.repeats, 3))
        if record_dir(args.record):
            units = {
                name: "GFLOP/s" for cells in rows.values() for name in cells if "GFLOP" in name
            }
            units |= {name: "×" for cells in rows.values() for name in cells if "/ oneDNN" in name}
            record = make_record("half_tiles", this_command(), rows, units=units)
            write_record(record_dir(args.record), record)
        return
    if args.peak:
        rows = peak(kernels)
        if record_dir(args.record):
            units = {name: "×" for cells in rows.values() for name in cells if "/" in name}
            units |= {name: "G/s" for cells in rows.values() for name in cells if "/" not in name}
            record = make_record("int16_peak", this_command(), rows, units=units)
            write_record(record_dir(args.record), record)
        return
    if args.step:
        step_linears(
            kernels,
            args.rows,
            args.kernels,
            args.repeats,
            baseline_kernels(args.baseline) if args.baseline else None,
            tuple(args.threads),
        )
        return
    rng = np.random.default_rng(0)
    for rows, cols, qtype in SHAPES:
        dense_w = rng.standard_normal((rows, cols)).astype(np.float32)
        blocks = torch.from_numpy(quantize(dense_w, qtype))
        tiles = kernels.repack_tiles(int(qtype), blocks, cols)
        onednn = make_linear_kernel(torch.from_numpy(dense_w), None, "onednn")
        reps = 50 if rows < 10_000 else 10
        all_rows = torch.arange(rows)
        for m in (1, 4, 16, 64):
            x, out = torch.randn(m, cols), torch.empty(m, rows)
            t_quant = per_call(lambda: kernels.matmul(int(qtype), blocks, cols, x, out), reps)
            t_tiles = {
                mode: per_call(
                    lambda: kernels.tile_matmul(int(qtype), tiles, rows, cols, x, out, mode), reps
                )
                for mode in TILE_ACTIVATIONS
                if mode != "bf16" or kernels.bf16_engine
            }
            t_dense = per_call(lambda: onednn(x), reps)
            t_gemm = per_call(
                lambda: F.linear(x, kernels.dequant_rows(int(qtype), blocks, cols, all_rows)), reps
            )
            print(
                f"{qtype.name} {rows}x{cols} rows={m}: block kernel {t_quant * 1e3:.3f} ms, "
                + "".join(f"tiles {mode} {t * 1e3:.3f} ms, " for mode, t in t_tiles.items())
                + f"dequantize+GEMM {t_gemm * 1e3:.3f} ms, oneDNN fp32 {t_dense * 1e3:.3f} ms "
                f"(fp32 / block kernel {t_dense / t_quant:.2f}, "
                f"/ int16 tiles {t_dense / t_tiles['int16']:.2f})"
            )
        scratch = torch.empty(
            rows, cols
        )  # the DequantBuffer's case: dequantize into a reused tensor
        t_fresh = per_call(lambda: kernels.dequant_rows(int(qtype), blocks, cols, all_rows), reps)
        t_reused = per_call(
            lambda: kernels.dequant_rows(int(qtype), blocks, cols, all_rows, out=scratch), reps
        )
        print(
            f"{qtype.name} {rows}x{cols} dequantize: fresh tensor {t_fresh * 1e3:.3f} ms, "
            f"reused {t_reused * 1e3:.3f} ms ({t_fresh / t_reused:.1f}x)"
        )


if __name__ == "__main__":
    main()
