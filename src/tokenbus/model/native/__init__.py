"""Native CPU kernels (L2): C sources next to this file, built on first use, loaded with ctypes.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbus.model.kv_quant import QUANTIZED_KV_DTYPES
from tokenbus.model.native.signatures import bind
from tokenbus.utils import cache_dir
from tokenbus.utils.cpu import CpuFeatures

OPT_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
# No -ffast-math when linking: GCC < 13 then links crtfastmath.o, whose constructor turns on
# flush-to-zero / denormals-are-zero for the whole process at dlopen, changing every later
# torch op (denormals become 0) in a process that loads us.
LINK_FLAGS = ("-shared", "-fopenmp")
_SOURCE = Path(__file__).with_name("paged_attention.c")
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
# activation dtype (fp16, fp8 or q8_0 K/V under fp32 queries: a half or a quarter of the bytes).
_ELEMS = (torch.float32, torch.bfloat16, torch.float16, *QUANTIZED_KV_DTYPES)
KERNEL_DTYPES = {dtype: code for code, dtype in enumerate(_ELEMS)}
KERNEL_KV_DTYPES = {
    torch.float32: (torch.float32, torch.float16, *QUANTIZED_KV_DTYPES),
    torch.bfloat16: (torch.bfloat16,),
}


@dataclass(frozen=True)
class PagedAttentionKernel:
    """fp32/bf16 paged attention over K/V read in place, fp16/fp8/q8_0 K/V under fp32 (see
    paged_attention.c for the contract). `long_queries`: its flash path for prefill chunks
    (paged_prefill_attention: fp32 queries, head sizes a multiple of 16), where it is built.
    quantize_fn / dequantize_fn: kv_quant.h's row conversions alone (tests)."""

    fn: ctypes._CFuncPtr
    long_fn: ctypes._CFuncPtr
    long_supported_fn: ctypes._CFuncPtr
    quantize_fn: ctypes._CFuncPtr | None = None
    dequantize_fn: ctypes._CFuncPtr | None = None

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        reqs: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        long_queries: bool = False,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int | None = None,
    ) -> None:
        """Fill out[rows of reqs] from q [T, Hq, D] (row-strided), kv_cache [2, NB, bs, Hkv, row]
        (a row: D values in the cache's type, kv_quant.py); by the flash path when
        `long_queries` (then takes_long_queries must hold). k_scale, v_scale: fp8 K/V's
        per-tensor scales. `window`: a sliding window (each query sees its last `window` keys,
        itself included); None: every earlier key."""
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        assert (
            q.stride(2) == 1
            and q.stride(1) == head_dim
            and out.stride(2) == 1
            and out.stride(1) == head_dim
        )
        # the index tensors are checked once per step: check_indices
        assert kv_cache.is_contiguous()
        assert q.dtype == out.dtype and kv_cache.dtype in KERNEL_KV_DTYPES.get(q.dtype, ())
        fn = self.long_fn if long_queries else self.fn
        status = fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            num_heads,
            block_tables.data_ptr(),
            block_tables.stride(0),
            query_start.data_ptr(),
            seq_lens.data_ptr(),
            reqs.data_ptr(),
            reqs.numel(),
            ctypes.c_float(scale),
            ctypes.c_float(k_scale),
            ctypes.c_float(v_scale),
            out.data_ptr(),
            out.stride(0),
            KERNEL_DTYPES[q.dtype],
            KERNEL_DTYPES[kv_cache.dtype],
            torch.get_num_threads(),
            window or 0,
        )
        if status == -2:
            raise ValueError(
                f"paged_prefill_attention does not take {q.dtype} queries over {kv_cache.dtype} "
                f"K/V at head size {head_dim} here (takes_long_queries)"
            )
        if status != 0:
            raise MemoryError("paged_attention: out of memory for its scratch buffers")

    def takes_long_queries(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the flash path runs these queries, K/V and head size (fp32 queries; fp32,
        fp16, fp8 or q8_0 K/V; head size a multiple of 16 up to 256; a build with
        AVX2+FMA+F16C or AVX-512)."""
        if dtype not in KERNEL_DTYPES or kv_dtype not in KERNEL_DTYPES:
            return False
        return bool(self.long_supported_fn(KERNEL_DTYPES[dtype], KERNEL_DTYPES[kv_dtype], head_dim))


def check_indices(*index: torch.Tensor) -> None:
    """The kernel reads block tables, query starts, sequence lengths and request ids as
    row-major int64 arrays in host memory."""
    for tensor in index:
        assert (
            tensor.dtype == torch.int64 and tensor.device.type == "cpu" and tensor.stride(-1) == 1
        )


def load_paged_attention(
    cpu: CpuFeatures | None = None, source: Path = _SOURCE
) -> PagedAttentionKernel:
    """Build (or find in the cache) and load the kernel; NativeBuildError says why not.
    `source`: another paged_attention.c (with its headers beside it), for a benchmark to time a
    kernel change against the build before it in one process (benchmarks/attention_layer.py)."""
    lib = load_library(source, cpu)
    return PagedAttentionKernel(
        *(
            bind(lib, name)
            for name in (
                "paged_attention",
                "paged_prefill_attention",
                "paged_prefill_supported",
                "kv_quantize_rows",
                "kv_dequantize_rows",
            )
        )
    )


_QUANT_SOURCE = Path(__file__).with_name("quant_matmul.c")
_TILE_SOURCE = Path(__file__).with_name("quant_tiles.c")
# Largest activation batch quant_matmul takes (MAX_M in quant_matmul.c).
QUANT_MAX_ROWS = 64
# Rows up to which the block kernel beats dequantize + GEMM, at SmolLM2's shapes:
# benchmarks/quant_linear.py decides this threshold.
QUANT_GEMV_MAX_ROWS = min(16, QUANT_MAX_ROWS)
# Likewise on 16-row tiles with int16 activations: they win at every size the kernel takes
# (benchmarks/quant_linear.py --step --rows 64 checks it against dequantize + GEMM).
TILE_GEMV_MAX_ROWS = QUANT_MAX_ROWS


# Rows per tile of quant_tiles.c (which GGML types it repacks, and into which format: its
# tile_format).
TILE_ROWS = 16
# How quant_tiles.c takes the activations (its ACT_*): as they are, or rounded per 32 values.
TILE_ACTIVATIONS = {"fp32": 0, "int8": 1, "int16": 2, "bf16": 3}
# What quant_tiles.c's tile_bf16_engine() answers: how "bf16" activations run (none, AVX512-BF16
# dot products, AMX tiles).
BF16_ENGINES = ("", "avx512_bf16", "amx")


@dataclass(frozen=True)
class QuantKernels:
    """GGUF-block kernels: on W in GGUF rows, uint8 [N, row_bytes] (quant_matmul.c: every
    kernel type, weight-only), and on W repacked in 16-row tiles, uint8 [ceil(N / 16),
    tile_bytes] (quant_tiles.c: Q8_0/Q4_0/Q4_1/Q4_K/Q6_K, fp32, int8, int16 or bf16 activations)."""

    matmul_fn: ctypes._CFuncPtr
    dequant_fn: ctypes._CFuncPtr
    tile_fns: dict[str, ctypes._CFuncPtr] | None  # None: this CPU has no tiled kernels
    bf16_engine: str = (
        ""  # what runs tile_matmul's "bf16" activations here (BF16_ENGINES; "": none)
    )
    isa: str = (
        ""  # the vector level the kernels were built for (CpuFeatures.isa: avx512, avx2, baseline)
    )

    def tiles(self, qtype: int) -> bool:
        """Whether weights of this GGML type are repacked in tiles here."""
        return self.tile_fns is not None and self.tile_fns["format"](qtype) >= 0

    def tile_format(self, qtype: int) -> int:
        """The GGML type whose tile format holds W of type `qtype` once repacked (its own, or
        Q8_0 for Q5_0 / IQ4_NL, Q6_K for Q3_K / IQ4_XS): the qtype the tile kernels then take."""
        assert self.tiles(qtype)
        return self.tile_fns["format"](qtype)

    def repack_tiles(
        self, qtype: int, w: torch.Tensor | Sequence[torch.Tensor], num_cols: int
    ) -> torch.Tensor:
        """W in GGUF rows -> a new uint8 [ceil(N / 16), tile_bytes] in 16-row tiles of
        tile_format(qtype). W may come in parts stacked along N (fused q/k/v): each part is
        repacked straight into its tiles, with no stacked copy of the blocks first; every part
        but the last must then have a multiple of 16 rows (a part's tiles start a tile)."""
        parts = [w] if isinstance(w, torch.Tensor) else list(w)
        assert self.tiles(qtype)
        assert all(p.dtype == torch.uint8 and p.is_contiguous() for p in parts)
        assert all(p.shape[0] % TILE_ROWS == 0 for p in parts[:-1])
        rows = sum(p.shape[0] for p in parts)
        nbytes = self.tile_fns["nbytes"](qtype, rows, num_cols)
        num_tiles = -(-rows // TILE_ROWS)
        out = torch.empty(num_tiles, nbytes // num_tiles, dtype=torch.uint8)
        first = 0
        for part in parts:
            status = self.tile_fns["repack"](
                qtype, part.data_ptr(), part.shape[0], num_cols, out[first // TILE_ROWS].data_ptr()
            )
            if status != 0:
                raise ValueError(
                    f"tile_repack: GGML type {qtype} with {num_cols} columns is not supported"
                )
            first += part.shape[0]
        return out

    def tile_matmul(
        self,
        qtype: int,
        tiles: torch.Tensor,
        num_rows: int,
        num_cols: int,
        x: torch.Tensor,
        out: torch.Tensor,
        activations: str,
    ) -> None:
        """out[M, N] (row-strided) = x[M, K] @ W.T, W tiled (num_rows = N); `activations`
        (TILE_ACTIVATIONS) int8 / int16 round x per 32-value block first (any M), bf16 rounds x
        and W to bf16 (any M; where `bf16_engine`: AMX tiles or AVX512-BF16 dot products), fp32
        takes up to QUANT_MAX_ROWS rows (quant_tiles.c)."""
        assert (
            tiles.dtype == torch.uint8
            and tiles.is_contiguous()
            and x.dtype == out.dtype == torch.float32
        )
        assert (
            x.stride(1) == 1
            and out.stride(1) == 1
            and (x.shape[0] <= QUANT_MAX_ROWS or activations != "fp32")
        )
        assert x.shape[1] == num_cols and out.shape == (x.shape[0], num_rows)
        assert tiles.numel() == self.tile_fns["nbytes"](qtype, num_rows, num_cols), (
            "tiles of another shape"
        )
        status = self.tile_fns["matmul"](
            qtype,
            tiles.data_ptr(),
            num_rows,
            num_cols,
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            TILE_ACTIVATIONS[activations],
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"tile_matmul: GGML type {qtype} with {num_cols} columns is not supported"
            )

    def tile_dequant_rows(
        self, qtype: int, tiles: torch.Tensor, num_rows: int, num_cols: int, rows: torch.Tensor
    ) -> torch.Tensor:
        """fp32 [len(rows), K]: the given rows (int64 ids) of a tiled W."""
        assert rows.dtype == torch.int64 and rows.is_contiguous()
        out = torch.empty(rows.numel(), num_cols, dtype=torch.float32)
        status = self.tile_fns["dequant_rows"](
            qtype,
            tiles.data_ptr(),
            num_rows,
            num_cols,
            rows.data_ptr(),
            rows.numel(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"tile_dequant_rows: GGML type {qtype} with {num_cols} columns is not supported"
            )
        return out

    def tile_dequant_t(
        self,
        qtype: int,
        tiles: torch.Tensor,
        num_rows: int,
        num_cols: int,
        first_tile: int,
        out: torch.Tensor,
    ) -> None:
        """out [K, 16 * count] (row-strided) = W^T of tiles [first_tile, first_tile + count)."""
        assert out.dtype == torch.float32 and out.stride(1) == 1 and out.shape[0] == num_cols
        assert out.shape[1] % TILE_ROWS == 0
        status = self.tile_fns["dequant_t"](
            qtype,
            tiles.data_ptr(),
            num_rows,
            num_cols,
            first_tile,
            out.shape[1] // TILE_ROWS,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"tile_dequant_t: GGML type {qtype} with {num_cols} columns is not supported"
            )

    def matmul(
        self, qtype: int, w: torch.Tensor, num_cols: int, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out[M, N] (row-strided, may be a column slice of a wider tensor) = x[M, K] @ W.T."""
        assert (
            w.dtype == torch.uint8 and w.is_contiguous() and x.dtype == out.dtype == torch.float32
        )
        assert x.stride(1) == 1 and out.stride(1) == 1 and x.shape[0] <= QUANT_MAX_ROWS
        status = self.matmul_fn(
            qtype,
            w.data_ptr(),
            w.shape[0],
            num_cols,
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"quant_matmul: GGML type {qtype} with {num_cols} columns is not supported"
            )

    def dequant_rows(
        self,
        qtype: int,
        w: torch.Tensor,
        num_cols: int,
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 [len(rows), K]: the given rows of W (int64 row ids), into `out` if given."""
        assert (
            w.dtype == torch.uint8
            and w.is_contiguous()
            and rows.dtype == torch.int64
            and rows.is_contiguous()
        )
        if out is None:
            out = torch.empty(rows.numel(), num_cols, dtype=torch.float32)
        assert (
            out.dtype == torch.float32
            and out.is_contiguous()
            and out.shape == (rows.numel(), num_cols)
        )
        status = self.dequant_fn(
            qtype,
            w.data_ptr(),
            num_cols,
            rows.data_ptr(),
            rows.numel(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"quant_dequant_rows: GGML type {qtype} with {num_cols} columns is not supported"
            )
        return out


def load_quant_kernels(
    cpu: CpuFeatures | None = None, tile_source: Path = _TILE_SOURCE
) -> QuantKernels:
    """Build (or find in the cache) and load the quantized kernels; NativeBuildError says why not.
    `tile_source`: another quant_tiles.c (with its headers beside it), for a benchmark to time a
    kernel change against the build before it in one process (benchmarks/quant_linear.py)."""
    lib = load_library(_QUANT_SOURCE, cpu)
    matmul, dequant = bind(lib, "quant_matmul"), bind(lib, "quant_dequant_rows")
    tile_fns = _load_tile_fns(cpu, tile_source)
    engine = BF16_ENGINES[tile_fns["bf16_engine"]()] if tile_fns is not None else ""
    return QuantKernels(
        matmul, dequant, tile_fns, bf16_engine=engine, isa=(cpu or CpuFeatures.detect()).isa
    )


def _load_tile_fns(cpu: CpuFeatures | None, source: Path) -> dict[str, ctypes._CFuncPtr] | None:
    """quant_tiles.c's entry points, or None where this CPU has no tiled kernels (below AVX2)."""
    lib = load_library(source, cpu)
    if not bind(lib, "tile_supported")():
        return None
    return {
        key: bind(lib, f"tile_{key}")
        for key in (
            "nbytes",
            "repack",
            "matmul",
            "dequant_rows",
            "dequant_t",
            "bf16_engine",
            "format",
        )
    }


_FUSED_SOURCE = Path(__file__).with_name("fused_ops.c")


@dataclass(frozen=True)
class FusedOps:
    """fp32 CPU elementwise steps of a decoder layer in one C call each (fused_ops.c)."""

    add_rms_norm_fn: ctypes._CFuncPtr
    rope_fn: ctypes._CFuncPtr
    silu_mul_fn: ctypes._CFuncPtr

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual) for x [T, H] (residual None: x alone)."""
        assert x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
        assert residual is None or (residual.dtype == torch.float32 and residual.stride(1) == 1)
        num_tokens, hidden = x.shape
        residual_out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        self.add_rms_norm_fn(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            residual_out.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            num_tokens,
            hidden,
            ctypes.c_float(eps),
            torch.get_num_threads(),
        )
        return out, residual_out

    def rope_(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_rot_heads: int,
        head_dim: int,
    ) -> None:
        """Rotate (rotate-half) the first num_rot_heads heads of each row of qkv [T, *] in place,
        by cos/sin [T, head_dim / 2] (contiguous)."""
        assert qkv.dtype == cos.dtype == sin.dtype == torch.float32 and qkv.stride(1) == 1
        assert (
            cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == (qkv.shape[0], head_dim // 2)
        )
        self.rope_fn(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            num_rot_heads,
            head_dim,
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2I] (contiguous) -> [T, I]."""
        assert gate_up.dtype == torch.float32 and gate_up.is_contiguous() and gate_up.dim() == 2
        num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_tokens, size, dtype=torch.float32)
        self.silu_mul_fn(
            gate_up.data_ptr(), num_tokens, size, out.data_ptr(), torch.get_num_threads()
        )
        return out


def load_fused_ops(cpu: CpuFeatures | None = None) -> FusedOps:
    """Build (or find in the cache) and load fused_ops.c; NativeBuildError says why not."""
    lib = load_library(_FUSED_SOURCE, cpu)
    return FusedOps(*(bind(lib, name) for name in ("add_rms_norm", "rope_inplace", "silu_mul")))
