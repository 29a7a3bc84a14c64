"""The ctypes side of kernels.h, in one table: every native function Python calls, its return
type and its arguments, one letter each (p pointer, l int64_t, i int, f float; v: returns
nothing). `bind` is the only place restype and argtypes are set; tests/model/test_native_abi.py
parses kernels.h and checks this table against it, letter by letter."""

from __future__ import annotations

import ctypes

_CTYPES = {"p": ctypes.c_void_p, "l": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}
_RESTYPES = {**_CTYPES, "v": None}

# name -> (return letter, argument letters), grouped by the source that defines them.
SIGNATURES: dict[str, tuple[str, str]] = {
    # paged_attention.c
    "paged_attention": ("i", "plplllllplppplfffpliiilfp"),
    "paged_prefill_attention": ("i", "plplllllplppplfffpliiilfp"),
    "paged_prefill_supported": ("i", "iil"),
    "kv_quantize_rows": ("i", "ppllif"),
    "kv_dequantize_rows": ("i", "pllip"),
    # quant_matmul.c
    "quant_matmul": ("i", "ipllpllpli"),
    "quant_dequant_rows": ("i", "iplplpi"),
    # quant_tiles.c
    "tile_supported": ("i", ""),
    "tile_bf16_engine": ("i", ""),
    "tile_q8_k": ("i", ""),
    "tile_super_block": ("i", "l"),
    "tile_format": ("i", "i"),
    "tile_nbytes": ("l", "ill"),
    "tile_repack": ("i", "ipllp"),
    "tile_matmul": ("i", "ipllpllplii"),
    "tile_dequant_rows": ("i", "ipllplpi"),
    "tile_dequant_t": ("i", "ipllllpli"),
    # fused_ops.c
    "add_rms_norm": ("v", "plplpppllfi"),
    "rope_inplace": ("v", "pllppllli"),
    "silu_mul": ("v", "pllpi"),
    "gelu_tanh_mul": ("v", "pllpi"),
    "clamped_swiglu_mul": ("v", "pllffpi"),
    "ssm_decode_step": ("v", "plplplpppplpplllli"),
    "gated_delta_rule": ("v", "plplppppppllllli"),
    # dense_rows.c
    "dense_panel_floats": ("l", "ll"),
    "dense_pack": ("v", "pllp"),
    "dense_matmul": ("i", "pllpllpli"),
    # decode_layer.c
    "decode_layer": ("i", "pplpppppp"),
    "decode_layers": ("i", "pplpppp"),
}


def bind(lib: ctypes.CDLL, name: str) -> ctypes._CFuncPtr:
    """lib's function `name`, with its restype and argtypes from SIGNATURES."""
    restype, args = SIGNATURES[name]
    fn = getattr(lib, name)
    fn.restype = _RESTYPES[restype]
    fn.argtypes = [_CTYPES[letter] for letter in args]
    return fn
