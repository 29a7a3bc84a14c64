"""What this CPU can run, so every fast path is chosen at run time (L0, stdlib only).

The flags come from /proc/cpuinfo (Linux's names: avx2, avx512bw, avx512_bf16, amx_bf16, ...).
`$TOKENBUS_CPU_ISA` caps what tokenbus believes the CPU has, to exercise a portable path on a
machine that has more (tests, bug reports from older CPUs):

    native       what the CPU reports (default)
    avx512_bf16  x86-64-v4 + AVX512-VNNI/BF16 where reported, no AMX (an AMD Zen 4, a Cooper
                 Lake): on an AMX CPU, bf16 activations take the AVX512-BF16 dot products
    avx512       x86-64-v4: AVX-512 F/BW/CD/DQ/VL, no BF16/FP16/VNNI extensions or AMX
    avx2         x86-64-v3: AVX2 + FMA, no AVX-512, AMX or AVX-VNNI (an AMD Zen 3)
    baseline     x86-64: SSE2 only

The cap steers tokenbus's own choices (packed linears, the attention kernel's -march); torch
and oneDNN still pick their inner kernels from the real CPU unless `ATEN_CPU_CAPABILITY` and
`ONEDNN_MAX_CPU_ISA` cap those. torch's cap is honoured here too (the lower of the two wins):
under ATEN_CPU_CAPABILITY=avx2 torch itself refuses to pack bf16 weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CPU_ISA_ENV = "TOKENBUS_CPU_ISA"
ISA_CAPS = ("native", "avx512_bf16", "avx512", "avx2", "baseline")  # widest first
# torch's own ISA cap, in our names (its other values are not x86 and cap nothing here).
_ATEN_CAPS = {"default": "baseline", "avx2": "avx2", "avx512": "avx512"}

# The psABI level a capped build compiles for, by the widest level its flags still have (`isa`;
# GCC >= 11 and clang >= 12 know these names).
_MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": "x86-64"}
# The extensions the avx512_bf16 cap keeps on top of x86-64-v4 (where the CPU reports them), with
# the GCC flags that enable them.
_V4_EXTRAS = {"avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
# oneDNN's packed bf16 linear (torch's mkldnn_bf16_device_check): either set suffices.
BF16_PACKED_LINEAR_FLAGS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))
# Hardware bf16 dot products; without them bf16 matmuls are emulated (slower than fp32).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


@functools.cache
def _reported_flags() -> frozenset[str]:
    """The CPU's flags; read once per process (they cannot change under it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _capped(flags: frozenset[str], cap: str) -> frozenset[str]:
    if cap == "native":
        return flags
    # Everything newer than AVX2: every AVX-512 extension, AMX, and the VEX-coded AVX-VNNI /
    # AVX-IFMA / AVX-NE-CONVERT families that x86-64-v3 does not include.
    beyond_v3 = {f for f in flags if f.startswith(("avx512", "amx", "avx_"))}
    if cap == "avx512_bf16":
        return (flags - beyond_v3) | (flags & (_V4 | _V4_EXTRAS.keys()))
    if cap == "avx512":
        return (flags - beyond_v3) | (flags & _V4)
    if cap == "avx2":
        return flags - beyond_v3
    return flags - beyond_v3 - _V3


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    cap: str = "native"

    @classmethod
    def detect(cls) -> CpuFeatures:
        """This CPU's features under `$TOKENBUS_CPU_ISA` (read on every call, so a test or a
        child process can set it)."""
        cap = os.environ.get(CPU_ISA_ENV, "native").strip().lower() or "native"
        if cap not in ISA_CAPS:
            raise ValueError(f"{CPU_ISA_ENV} must be one of {ISA_CAPS}, got {cap!r}")
        aten = _ATEN_CAPS.get(os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower(), "native")
        cap = max(cap, aten, key=ISA_CAPS.index)
        return cls(_capped(_reported_flags(), cap), cap)

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    @property
    def is_x86(self) -> bool:
        return platform.machine().lower() in ("x86_64", "amd64")

    @property
    def isa(self) -> str:
        """The widest vector level: 'avx512', 'avx2' or 'baseline' (what a kernel targets)."""
        if self.has(*_V4):
            return "avx512"
        return "avx2" if self.has("avx2", "fma") else "baseline"

    @property
    def march(self) -> str:
        """The -march a native kernel is built with: the CPU itself unless capped, else the
        level the capped flags reach. A cap narrows, never widens: TOKENBUS_CPU_ISA=avx512 on
        an AVX2-only CPU builds for x86-64-v3, not for instructions the CPU lacks."""
        return _MARCH[self.isa] if self.is_x86 and self.cap != "native" else "native"

    @property
    def march_extras(self) -> tuple[str, ...]:
        """Flags that enable, on top of a capped -march, the extensions the cap keeps."""
        if self.cap != "avx512_bf16" or not self.is_x86 or self.isa != "avx512":
            return ()
        return tuple(flag for name, flag in _V4_EXTRAS.items() if name in self.flags)

    def missing_for_bf16_packed_linear(self) -> tuple[str, ...]:
        """() when oneDNN can pack bf16 weights here, else the instructions it lacks (of the
        closest of the alternatives)."""
        if not self.is_x86:
            return ()  # torch's check is x86-only
        missing = [
            tuple(f for f in option if f not in self.flags) for option in BF16_PACKED_LINEAR_FLAGS
        ]
        return () if any(not m for m in missing) else missing[0]

    @property
    def has_bf16_dot(self) -> bool:
        return any(flag in self.flags for flag in BF16_DOT_FLAGS)

    def describe(self) -> str:
        """One line for logs and benchmark records: ISA level and the bf16/AMX extras."""
        extras = [
            f
            for f in (
                "avx512_vnni",
                "avx_vnni",
                "avx512_bf16",
                "amx_bf16",
                "amx_int8",
                "avx512_fp16",
            )
            if f in self.flags
        ]
        capped = "" if self.cap == "native" else f" (capped by {CPU_ISA_ENV}={self.cap})"
        return f"{self.isa}" + (f" + {', '.join(extras)}" if extras else "") + capped


def usable_affinity_cpus() -> int:
    """CPUs in this process's affinity mask (the machine's count where there is no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_cpus() -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup CPU quota (a
    container's --cpus), not the machine's count."""
    cores = usable_affinity_cpus()
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs' worth of time this process's cgroup may use per period (cgroup v2 cpu.max, or v1
    cfs_quota_us / cfs_period_us), or None when unlimited or unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2: "0::/path"
            quota = _read_pair(root / rel / "cpu.max", " ")
        elif "cpu" in controllers.split(","):
            directory = root / controllers / rel
            quota = _read_pair(
                directory / "cpu.cfs_quota_us", None, directory / "cpu.cfs_period_us"
            )
        else:
            continue
        if quota is not None:
            return quota
    return None


def _read_pair(path: Path, sep: str | None, second: Path | None = None) -> float | None:
    """quota / period from "quota period" in one file (sep) or from two files; None if
    unlimited ("max" or -1) or unreadable."""
    try:
        if second is None:
            quota, period = path.read_text().split(sep)[:2]
        else:
            quota, period = path.read_text().strip(), second.read_text().strip()
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


# libgomp's spin before a waiting thread sleeps (iterations). Its default (300k) lets spinning
# threads steal a core the engine shares with another process; too short a spin costs a sleep
# and a wake wherever a step's parallel regions come close together. benchmarks/shared_cores.sh
# (a CPU hog on one core) and benchmarks/serve_ab.sh (a quiet machine) decide the count.
ENGINE_GOMP_SPINCOUNT = "10000"


# oneDNN (the packed fp32/bf16 linears of model/layers/linear.py) builds a primitive per input
# shape, and a step's shape is its token count, which changes from step to step. ideep
# (LRU_CACHE_CAPACITY) and oneDNN (ONEDNN_PRIMITIVE_CACHE_CAPACITY) each keep 1024 of them by
# default, and one is freed only once both have dropped it: with --quantization none the
# engine's memory net of the KV pool kept climbing (benchmarks/soak.sh). 128 holds every decode
# batch size of a busy engine (5 linear shapes each); a miss rebuilds a primitive.
ENGINE_ONEDNN_CACHE_CAPACITY = "128"
ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


@contextlib.contextmanager
def engine_process_env() -> Iterator[None]:
    """The environment a spawned engine or rank process starts with (around Process.start()):
    a shorter OpenMP spin than libgomp's (ENGINE_GOMP_SPINCOUNT) unless the user set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT, and bounded oneDNN primitive
    caches unless the user sized them. The front end's own environment is restored afterwards."""
    defaults = {name: ENGINE_ONEDNN_CACHE_CAPACITY for name in ONEDNN_CACHE_VARIABLES}
    if "OMP_WAIT_POLICY" not in os.environ:
        defaults["GOMP_SPINCOUNT"] = ENGINE_GOMP_SPINCOUNT
    added = [name for name in defaults if name not in os.environ]
    os.environ.update({name: defaults[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
