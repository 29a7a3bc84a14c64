"""The quantized block kernel against oneDNN's packed fp32 linear at SmolLM2's shapes, and the
dequantize + GEMM path, per activation row count; and dequantizing into a fresh tensor vs a
reused one (2 threads).

    .venv/bin/python benchmarks/quant_linear.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from tokenbus.model.layers.linear import make_linear_kernel
from tokenbus.model.native import load_quant_kernels
from tokenbus.utils.cpu import CpuFeatures

SHAPES = [(3072, 576, Q.Q4_1), (576, 1536, Q.Q4_1), (49152, 576, Q.Q8_0)]  # gate_up, down, tied LM head


def per_call(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    torch.set_num_threads(2)
    print(f"CPU: {CpuFeatures.detect().describe()}")
    kernels = load_quant_kernels()
    rng = np.random.default_rng(0)
    for rows, cols, qtype in SHAPES:
        dense_w = rng.standard_normal((rows, cols)).astype(np.float32)
        blocks = torch.from_numpy(quantize(dense_w, qtype))
        onednn = make_linear_kernel(torch.from_numpy(dense_w), None, "onednn")
        reps = 50 if rows < 10_000 else 10
        all_rows = torch.arange(rows)
        for m in (1, 4, 16, 64):
            x, out = torch.randn(m, cols), torch.empty(m, rows)
            t_quant = per_call(lambda: kernels.matmul(int(qtype), blocks, cols, x, out), reps)
            t_dense = per_call(lambda: onednn(x), reps)
            t_gemm = per_call(lambda: F.linear(x, kernels.dequant_rows(int(qtype), blocks, cols, all_rows)), reps)
            print(f"{qtype.name} {rows}x{cols} rows={m}: block kernel {t_quant * 1e3:.3f} ms, "
                  f"dequantize+GEMM {t_gemm * 1e3:.3f} ms, oneDNN fp32 {t_dense * 1e3:.3f} ms "
                  f"(fp32 / kernel {t_dense / t_quant:.2f})")
        scratch = torch.empty(rows, cols)  # the DequantBuffer's case: dequantize into a reused tensor
        t_fresh = per_call(lambda: kernels.dequant_rows(int(qtype), blocks, cols, all_rows), reps)
        t_reused = per_call(lambda: kernels.dequant_rows(int(qtype), blocks, cols, all_rows, out=scratch), reps)
        print(f"{qtype.name} {rows}x{cols} dequantize: fresh tensor {t_fresh * 1e3:.3f} ms, "
              f"reused {t_reused * 1e3:.3f} ms ({t_fresh / t_reused:.1f}x)")


if __name__ == "__main__":
    main()
