"""Building the native kernels (L2): each C source next to this file compiled on first use, loaded
with ctypes.

Built with the system C compiler (`$CC`, else `cc`) for this machine (-march=native, or the
x86-64 level that `$TOKENBUS_CPU_ISA` caps it to: utils/cpu.py) into a cache directory keyed by
the source, the flags and the CPU, so a later process loads the
shared object without compiling. No compiler, or a failed build, is not an error: `load_*`
returns None with the reason, and callers keep the portable torch path.

OpenMP: the object links `libgomp.so.1` by soname, and torch has already loaded its own copy
under that name, so both share one runtime and one thread pool instead of two spinning ones.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenbus.utils import cache_dir
from tokenbus.utils.cpu import CpuFeatures

OPT_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
# No -ffast-math when linking: GCC < 13 then links crtfastmath.o, whose constructor turns on
# flush-to-zero / denormals-are-zero for the whole process at dlopen, changing every later
# torch op (denormals become 0) in a process that loads us.
LINK_FLAGS = ("-shared", "-fopenmp")
_I64 = ctypes.c_int64


class NativeBuildError(RuntimeError):
    pass


def compile_flags(cpu: CpuFeatures) -> tuple[str, ...]:
    """-march from the CPU (its own instructions, or the capped x86-64 level), then -O3 & co.
    On AVX-512, loops the compiler vectorises use zmm registers: GCC's tuning for these CPUs
    otherwise stops at ymm, which halved the attention kernel's dot products and value sums
    (its intrinsics were 512-bit, the `omp simd` loops between them 256-bit)."""
    wide = ("-mprefer-vector-width=512",) if cpu.isa == "avx512" else ()
    return (f"-march={cpu.march}", *cpu.march_extras, *wide, *OPT_FLAGS)


def local_headers(text: bytes) -> list[str]:
    """The local headers a C source includes (`#include "name.h"`, next to it)."""
    return [name.decode() for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)]


def included_headers(read: Callable[[str], bytes], name: str) -> list[str]:
    """The local headers the file `name` includes, directly or through another header (each once,
    in the order first included); read(name) gives a file's bytes (from disk, or from git for an
    older revision: benchmarks/revisions.py)."""
    found: list[str] = []
    pending = local_headers(read(name))
    while pending:
        header = pending.pop(0)
        if header not in found:
            found.append(header)
            pending.extend(local_headers(read(header)))
    return found


def source_texts(source: Path) -> list[bytes]:
    """`source` and every local header it includes: what the cache key hashes, so editing a
    header rebuilds every object that includes it, however deep."""

    def read(name: str) -> bytes:
        return source.with_name(name).read_bytes()

    return [read(name) for name in (source.name, *included_headers(read, source.name))]


def build_shared_object(source: Path, cpu: CpuFeatures | None = None) -> Path:
    """Compile `source` into the cache (once per source, flags, compiler and CPU); its path."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise NativeBuildError("no C compiler found (set $CC)")
    cpu = cpu or CpuFeatures.detect()
    compile_args = compile_flags(cpu)
    flags = " ".join(compile_args + LINK_FLAGS).encode()
    cpu_key = " ".join(sorted(cpu.flags)) or platform.processor()
    key = hashlib.sha256(
        b"\0".join(
            [
                *source_texts(source),
                flags,
                compiler.encode(),
                platform.machine().encode(),
                cpu_key.encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compile to a private name, then rename: concurrent builders (engine processes, test
        # workers) never load a half-written object.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise NativeBuildError(
            f"cannot write the kernel cache {target.parent} (set $TOKENBUS_CACHE_DIR): {exc}"
        ) from exc
    obj = tmp[: -len(".so")] + ".o"
    try:
        for command in (
            [compiler, *compile_args, "-c", "-o", obj, str(source)],
            [compiler, *LINK_FLAGS, "-o", tmp, obj, "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise NativeBuildError(
                    f"{compiler} failed on {source.name}: {done.stderr.strip()[-2000:]}"
                )
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"{compiler} could not build {source.name}: {exc}") from exc
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def load_library(source: Path, cpu: CpuFeatures | None = None) -> ctypes.CDLL:
    """Build (or find in the cache) and load `source`; NativeBuildError says why not."""
    try:
        return ctypes.CDLL(str(build_shared_object(source, cpu)))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {source.stem}: {exc}") from exc


# Element-type codes of kv_quant.h, ELEM_F32 = 0 .. ELEM_Q8_0 = 5 (the cache tensor's dtype names
# its type: uint8 is q8_0, model/kv_quant.py), and the KV cache dtypes the kernel reads under each
