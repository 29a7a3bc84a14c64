"""The Triton kernels compile for a Hopper GPU (sm_90), checked without one.

Triton's interpreter (the CPU tests) never compiles a kernel, so a construct only the compiler
refuses would first fail on a GPU machine. A fresh interpreter with TRITON_INTERPRET=0 compiles
each kernel ahead of time for the CUDA target, in every tile shape paged_attention and the
MoE expert GEMMs launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tokenbus.model import triton_attention as ta

    target = GPUTarget("cuda", 90, 32)
    pointers = ("q_ptr", "cache_ptr", "out_ptr")
    ints = ("stride_q_token", "stride_q_head", "stride_o_token", "stride_o_head",
            "stride_table", "split_kv", "window")
    compiled = 0
    # Every dtype in both tile shapes, then the other GQA groups, head size and block size.
    shapes = [(d, 4, 128, 16, q) for d, q in itertools.product(("bf16", "fp16", "fp32"), (1, 7))]
    shapes += [("bf16", g, 64, 16, q) for g, q in itertools.product((1, 3, 8), (1, 7))]
    shapes += [("bf16", 4, 128, 32, 1)]
    shapes = [shape + (False, shape[0]) for shape in shapes]
    shapes += [("bf16", 2, 256, 16, q, True, "bf16") for q in (1, 7)]  # Gemma 2: soft-cap, 256
    shapes += [("bf16", 4, 128, 16, q, False, c) for q in (1, 7) for c in ("fp8e4nv", "fp8e5")]
    # The tiny test models (head size 16, GQA 2) in fp32 and bf16; K/V below the queries' type.
    shapes += [(d, 2, 16, 16, q, False, d) for d in ("fp32", "bf16") for q in (1, 7)]
    shapes += [("fp32", 2, 64, 16, 7, False, c) for c in ("fp16", "bf16", "fp8e4nv")]
    shapes += [("fp16", 2, 64, 16, 1, False, c) for c in ("fp16", "fp8e5")]
    shapes = [shape + (False,) for shape in shapes]
    shapes += [("bf16", 8, 64, 16, q, False, "bf16", True) for q in (1, 7)]  # gpt-oss: sinks
    for dtype, group, head_dim, block_size, max_query_len, softcap, cache, sinks in shapes:
        block_g = triton.next_power_of_2(group)
        signature = {name: f"*{dtype}" for name in pointers}
        signature["cache_ptr"] = f"*{cache}"
        signature |= {"part_ptr": "*fp32", "block_tables_ptr": "*i64",
                      "query_start_ptr": "*i64", "seq_lens_ptr": "*i64", "scale": "fp32",
                      "cache_half": "i64", "softcap": "fp32", "sinks_ptr": "*fp32"}
        signature |= {name: "i32" for name in ints}
        constants = dict(NUM_KV_HEADS=8, GROUP=group, BLOCK_G=block_g,
                         BLOCK_M=ta.query_tile(block_g, max_query_len), HEAD_DIM=head_dim,
                         BLOCK_D=head_dim, BLOCK_SIZE=block_size, FP32_DOT=dtype == "fp32",
                         SOFTCAP=softcap, SINKS=sinks)
        signature |= {name: "constexpr" for name in constants}
        triton.compile(ASTSource(ta._attention_kernel, signature, constants), target=target)
        compiled += 1
    merge = {"part_ptr": "*fp32", "out_ptr": "*bf16", "query_start_ptr": "*i64",
             "stride_o_token": "i32", "stride_o_head": "i32", "split_kv": "i32"}
    constants = dict(NUM_HEADS=32, HEAD_DIM=128, BLOCK_D=128, MAX_SPLITS=ta.MAX_SPLITS)
    merge |= {name: "constexpr" for name in constants}
    triton.compile(ASTSource(ta._merge_splits_kernel, merge, constants), target=target)
    writes = [("bf16", "bf16", 0.0), ("bf16", "fp8e4nv", 448.0), ("bf16", "fp8e5", 57344.0)]
    writes += [("fp32", "fp32", 0.0), ("fp32", "fp16", 0.0), ("fp32", "fp8e4nv", 448.0)]
    for kv, cache, fp8_max in writes:
        write = {"k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "cache_ptr": f"*{cache}",
                 "slot_ptr": "*i64", "stride_k_token": "i32", "stride_k_head": "i32",
                 "stride_v_token": "i32", "stride_v_head": "i32", "cache_half": "i64"}
        constants = dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_D=128, FP8_MAX=fp8_max)
        write |= {name: "constexpr" for name in constants}
        triton.compile(ASTSource(ta._write_kv_kernel, write, constants), target=target)
        compiled += 1
    # The MoE expert GEMMs (triton_moe.py): both tile configs, gate_up (rows of tokens) and
    # down (rows of pairs, routed), in every model dtype.
    from tokenbus.model import triton_moe as tm
    gemm = {"a_ptr": None, "w_ptr": None, "c_ptr": None, "routing_ptr": None,
            "pairs_ptr": "*i64", "block_experts_ptr": "*i64", "num_padded_ptr": "*i64",
            "num_pairs": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
            "stride_w_expert": "i32", "stride_w_n": "i32", "stride_c": "i32"}
    configs = (tm.GemmConfig.for_step(1, 128), tm.GemmConfig.for_step(4096, 128))
    for dtype, config, (rows_per_pair, routed) in itertools.product(
        ("bf16", "fp16", "fp32"), configs, ((8, False), (1, True))
    ):
        signature = {name: kind or f"*{dtype}" for name, kind in gemm.items()}
        constants = dict(ROWS_PER_PAIR=rows_per_pair, ROUTED=routed, FP32_DOT=dtype == "fp32",
                         BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k)
        signature |= {name: "constexpr" for name in constants}
        triton.compile(ASTSource(tm._expert_gemm_kernel, signature, constants), target=target)
        compiled += 1
    print("compiled", compiled + 1)
    """
)


def test_kernels_compile_for_sm90_in_every_tile_shape():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    if "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("this triton has no ptxas for a CUDA target")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled 49" in result.stdout
