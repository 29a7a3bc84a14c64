"""CPU feature detection and the $TOKENBUS_CPU_ISA cap that forces each portable path."""

from __future__ import annotations

import pytest

from tokenbus.utils.cpu import CPU_ISA_ENV, CpuFeatures, _capped

# A Sapphire Rapids Xeon's SIMD flags (as in /proc/cpuinfo), plus the scalar ones that stay.
SPR = frozenset(
    "sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe abm avx512f "
    "avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 avx_vnni "
    "amx_tile amx_bf16 amx_int8".split()
)
ZEN3 = frozenset(
    "sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe abm".split()
)


def test_native_is_what_the_cpu_reports():
    cpu = CpuFeatures(SPR)
    assert cpu.isa == "avx512" and cpu.missing_for_bf16_packed_linear() == () and cpu.has_bf16_dot
    assert "avx512_bf16" in cpu.describe() and "amx_bf16" in cpu.describe()


def test_avx2_cap_is_a_zen3():
    cpu = CpuFeatures(_capped(SPR, "avx2"), "avx2")
    assert cpu.flags == ZEN3 and cpu.isa == "avx2" and not cpu.has_bf16_dot
    assert cpu.missing_for_bf16_packed_linear() == ("avx512bw", "avx512vl", "avx512dq")
    assert cpu.describe() == f"avx2 (capped by {CPU_ISA_ENV}=avx2)"
    if cpu.is_x86:
        assert cpu.march == "x86-64-v3"


def test_avx512_cap_keeps_only_x86_64_v4():
    cpu = CpuFeatures(_capped(SPR, "avx512"), "avx512")
    assert cpu.flags == ZEN3 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
    assert (
        cpu.isa == "avx512" and cpu.missing_for_bf16_packed_linear() == () and not cpu.has_bf16_dot
    )


def test_avx512_bf16_cap_is_a_zen4():
    """x86-64-v4 plus AVX512-VNNI/BF16, no AMX or FP16: the bf16 dot-product path on an AMX CPU."""
    cpu = CpuFeatures(_capped(SPR, "avx512_bf16"), "avx512_bf16")
    v4 = {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
    assert cpu.flags == ZEN3 | v4 | {"avx512_vnni", "avx512_bf16"} and cpu.has_bf16_dot
    without = CpuFeatures(_capped(ZEN3 | v4, "avx512_bf16"), "avx512_bf16")  # nothing is added
    assert without.flags == ZEN3 | v4 and not without.has_bf16_dot
    if cpu.is_x86:
        assert cpu.march == "x86-64-v4" and cpu.march_extras == ("-mavx512vnni", "-mavx512bf16")
        assert without.march_extras == () and CpuFeatures(SPR).march_extras == ()


@pytest.mark.parametrize("cap", ["avx512_bf16", "avx512"])
def test_a_cap_never_widens(cap):
    """An AVX-512 cap on an AVX2-only CPU (a Zen 3) builds for x86-64-v3, never for v4."""
    cpu = CpuFeatures(_capped(ZEN3, cap), cap)
    assert cpu.flags == ZEN3 and cpu.isa == "avx2"
    if cpu.is_x86:
        assert cpu.march == "x86-64-v3" and cpu.march_extras == ()


def test_baseline_cap_drops_avx():
    cpu = CpuFeatures(_capped(SPR, "baseline"), "baseline")
    assert cpu.isa == "baseline" and not cpu.has("avx") and cpu.has("sse4_2")


def test_avx_ne_convert_alone_packs_bf16():
    assert CpuFeatures(ZEN3 | {"avx_ne_convert"}).missing_for_bf16_packed_linear() == ()


def test_torchs_own_cap_is_honoured(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert CpuFeatures.detect().cap == "avx2"
    monkeypatch.setenv(CPU_ISA_ENV, "baseline")  # the lower cap wins
    assert CpuFeatures.detect().cap == "baseline"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv(CPU_ISA_ENV, "native")
    assert CpuFeatures.detect().cap == "baseline"


def test_detect_reads_the_cap_on_every_call(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv(CPU_ISA_ENV, "AVX2")
    capped = CpuFeatures.detect()
    assert capped.cap == "avx2" and not any(f.startswith("avx512") for f in capped.flags)
    monkeypatch.delenv(CPU_ISA_ENV)
    assert CpuFeatures.detect().cap == "native"
    monkeypatch.setenv(CPU_ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=f"{CPU_ISA_ENV} must be one of"):
        CpuFeatures.detect()


def test_cgroup_quota_v2_and_v1(tmp_path):
    from tokenbus.utils.cpu import cgroup_cpu_quota

    (tmp_path / "cg" / "app").mkdir(parents=True)
    (tmp_path / "cg" / "app" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "self").write_text("0::/app\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "self") == 1.5
    (tmp_path / "cg" / "app" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "self") is None
    v1 = tmp_path / "cg" / "cpu,cpuacct" / "box"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "self").write_text("4:memory:/box\n3:cpu,cpuacct:/box\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "self") == 0.5
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "missing") is None


def test_threads_follow_flag_cores_and_ranks(monkeypatch):
    from tokenbus.engine_args import EngineArgs
    from tokenbus.utils import cpu
    from tokenbus.worker import worker

    monkeypatch.setattr(worker, "available_cpus", lambda: 4)
    assert worker.cpu_threads(EngineArgs().to_config(64)) == 4
    assert worker.cpu_threads(EngineArgs(data_parallel_size=2).to_config(64)) == 2
    assert (
        worker.cpu_threads(EngineArgs(tensor_parallel_size=2, data_parallel_size=3).to_config(64))
        == 1
    )
    assert worker.cpu_threads(EngineArgs(num_threads=3).to_config(64)) == 3
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        EngineArgs(num_threads=0).to_config(64)
    assert cpu.available_cpus() >= 1


def test_engine_processes_spin_less_unless_the_user_chose(monkeypatch):
    import os

    from tokenbus.utils.cpu import ENGINE_GOMP_SPINCOUNT, engine_process_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with engine_process_env():  # libgomp's own default is 300k
        assert os.environ["GOMP_SPINCOUNT"] == ENGINE_GOMP_SPINCOUNT == "10000"
    assert "GOMP_SPINCOUNT" not in os.environ  # the front end's own environment is left alone
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with engine_process_env():
        assert "GOMP_SPINCOUNT" not in os.environ


def test_engine_processes_bound_onednn_caches_unless_the_user_sized_them(monkeypatch):
    """oneDNN keeps a primitive per token count a step had: unbounded (1024 + 1024 entries of
    ~1 MiB) it grew the engine's RSS for the whole of a soak (benchmarks/soak.py)."""
    import os

    from tokenbus.utils.cpu import (
        ENGINE_ONEDNN_CACHE_CAPACITY,
        ONEDNN_CACHE_VARIABLES,
        engine_process_env,
    )

    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # independent of the OpenMP choice
    with engine_process_env():
        assert all(
            os.environ[name] == ENGINE_ONEDNN_CACHE_CAPACITY for name in ONEDNN_CACHE_VARIABLES
        )
    assert not any(name in os.environ for name in ONEDNN_CACHE_VARIABLES)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "4096")
    with engine_process_env():
        assert os.environ["LRU_CACHE_CAPACITY"] == "4096"
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == ENGINE_ONEDNN_CACHE_CAPACITY
    assert os.environ["LRU_CACHE_CAPACITY"] == "4096"
