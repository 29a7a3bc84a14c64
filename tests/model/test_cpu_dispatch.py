"""Every CPU fast path is chosen by what the CPU supports; forcing each one (utils/cpu.py's
cap) runs the portable path correctly on a CPU that has more."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.fixtures.tiny_models import cached_tiny_model
from tests.model.test_native_attention import DECODES, both_paths

from tokenbus.loader import load_arch, resolve_model
from tokenbus.model.layers import Linear
from tokenbus.model.layers.linear import choose_linear_backend, make_linear_kernel
from tokenbus.model.native import compile_flags, load_paged_attention
from tokenbus.utils.cpu import CPU_ISA_ENV, CpuFeatures, _capped
from tokenbus.worker.model_builder import load_model
from tokenbus.worker.worker import cpu_dtype_warning

DETECTED = CpuFeatures.detect()
AVX2 = CpuFeatures(_capped(DETECTED.flags, "avx2"), "avx2")
BF16_PACK_MISSING = DETECTED.missing_for_bf16_packed_linear()
needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the native kernel cannot be built here",
)


def test_bf16_linears_run_dense_without_avx512_bw_vl_dq():
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    assert choose_linear_backend(w, "auto", AVX2) == "dense"
    assert choose_linear_backend(w.float(), "auto", AVX2) == "onednn"  # fp32 packing is AVX2-safe
    assert choose_linear_backend(w.half(), "auto", DETECTED) == "dense"
    with pytest.raises(
        ValueError,
        match="'onednn': packed bfloat16 linears need AVX-512 BW/VL/DQ or "
        "AVX-NE-CONVERT; this CPU lacks avx512bw, avx512vl, avx512dq",
    ):
        choose_linear_backend(w, "onednn", AVX2)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    assert torch.equal(make_linear_kernel(w, None, "auto", AVX2)(x), F.linear(x, w))


@pytest.mark.skipif(
    bool(BF16_PACK_MISSING),
    reason=f"packed bf16 linears need instructions this CPU lacks: {', '.join(BF16_PACK_MISSING)}",
)
def test_packed_bf16_linear_matches_dense():
    layer = Linear(64, [40, 24], bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 64))
        layer.bias.copy_(torch.randn(64))
    layer = layer.to(torch.bfloat16)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    layer.finalize("auto")
    assert layer.backend == "onednn"
    packed = layer(x)
    layer.finalize("dense")
    assert layer.backend == "dense"
    torch.testing.assert_close(packed.float(), layer(x).float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("cap", ["native", "avx2"])
def test_model_linears_follow_the_cpu(cap, monkeypatch):
    monkeypatch.setenv(CPU_ISA_ENV, cap)
    src = resolve_model(str(cached_tiny_model("llama")))
    backends = {
        dtype: {
            m.backend
            for m in load_model(src, load_arch(src), dtype, "cpu").modules()
            if isinstance(m, Linear)
        }
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert backends[torch.float32] == {"onednn"}
    packs_bf16 = not CpuFeatures.detect().missing_for_bf16_packed_linear()
    assert packs_bf16 == (
        cap == "native"
        and not BF16_PACK_MISSING
        and os.environ.get("ATEN_CPU_CAPABILITY", "").lower() not in ("avx2", "default")
    )
    assert backends[torch.bfloat16] == ({"onednn"} if packs_bf16 else {"dense"})


@needs_cc
@pytest.mark.parametrize("cap", ["avx2", "baseline", "avx512"])
def test_attention_kernel_built_for_each_isa_matches_torch(cap):
    cpu = CpuFeatures(_capped(DETECTED.flags, cap), cap)
    if cap == "avx512" and DETECTED.isa != "avx512":
        pytest.skip(
            f"an x86-64-v4 build needs AVX-512 F/BW/CD/DQ/VL; this CPU is {DETECTED.describe()}"
        )
    if not cpu.is_x86:
        pytest.skip("ISA caps apply to x86-64 only")
    assert compile_flags(cpu)[0] == f"-march={cpu.march}" and cpu.march.startswith("x86-64")
    kernel = load_paged_attention(cpu)
    out, ref, plan = both_paths(kernel, DECODES + [(5, 30)])
    assert plan.native is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_bf16_without_bf16_units_warns_but_runs():
    message = cpu_dtype_warning(torch.bfloat16, AVX2)
    assert message and "avx512_bf16" in message and "slower than float32" in message
    assert cpu_dtype_warning(torch.float32, AVX2) is None
    assert (
        cpu_dtype_warning(torch.bfloat16, CpuFeatures(frozenset({"avx2", "avx512_bf16"}))) is None
    )


def test_half_precision_with_torch_and_onednn_held_to_avx2():
    """The closest this machine gets to an AVX2-only EPYC: torch's own kernels
    (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and tokenbus's choices all capped, then
    the bf16/fp16 model and the linear-backend tests run in a fresh process."""
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", **{CPU_ISA_ENV: "avx2"}
    )
    tests = [
        "tests/model/test_llama_vs_hf.py::test_half_precision_runs_close_to_fp32",
        "tests/model/test_llama_vs_hf.py::test_dense_and_packed_linear_backends_agree",
        "tests/model/test_cpu_dispatch.py::test_model_linears_follow_the_cpu",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout or "6 passed" in done.stdout, done.stdout[-2000:]
