"""Native CPU kernels (L2): C sources next to this file, built on first use (build.py), loaded
with ctypes; a module per kernel object: paged_attention.py, quant_kernels.py (quant_matmul.c,
quant_tiles.c), fused_ops.py, dense_rows.py, and decode_layer.py over them all. kernels.h
declares their C ABI once; signatures.py is its ctypes side.

The names below are the package's interface: callers import them from here.
"""

from tokenbus.model.native.build import (
    LINK_FLAGS,
    OPT_FLAGS,
    NativeBuildError,
    build_shared_object,
    compile_flags,
    included_headers,
    load_library,
    local_headers,
    source_texts,
)
from tokenbus.model.native.fused_ops import FusedOps, load_fused_ops
from tokenbus.model.native.paged_attention import (
    KERNEL_DTYPES,
    KERNEL_KV_DTYPES,
    PagedAttentionKernel,
    check_indices,
    load_paged_attention,
)
from tokenbus.model.native.quant_kernels import (
    BF16_ENGINES,
    HALF_QTYPES,
    QUANT_GEMV_MAX_ROWS,
    QUANT_MAX_ROWS,
    TILE_ACTIVATIONS,
    TILE_GEMV_MAX_ROWS,
    TILE_ROWS,
    QuantKernels,
    load_quant_kernels,
)

__all__ = [
    "BF16_ENGINES",
    "HALF_QTYPES",
    "KERNEL_DTYPES",
    "KERNEL_KV_DTYPES",
    "LINK_FLAGS",
    "OPT_FLAGS",
    "QUANT_GEMV_MAX_ROWS",
    "QUANT_MAX_ROWS",
    "TILE_ACTIVATIONS",
    "TILE_GEMV_MAX_ROWS",
    "TILE_ROWS",
    "FusedOps",
    "NativeBuildError",
    "PagedAttentionKernel",
    "QuantKernels",
    "build_shared_object",
    "check_indices",
    "compile_flags",
    "included_headers",
    "load_fused_ops",
    "load_library",
    "load_paged_attention",
    "load_quant_kernels",
    "local_headers",
    "source_texts",
]
