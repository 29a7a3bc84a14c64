"""One paged-attention layer, torch path vs native kernel, on the same random cache.

`batch` decode requests with `context` keys each in shuffled 16-token blocks, SmolLM2's heads
(9 query, 3 KV, head size 64). Prints the best of `--repeats` calls and the largest difference,
and, for reference, the GB/s of a plain `torch.sum` streaming a ~176 MB fp32 tensor.
--kv-dtype float16 keeps the cache in fp16 under fp32 queries (--kv-cache-dtype).
--baseline REV also times git revision REV's kernel (its paged_attention.c and headers), the
paths taking turns call by call: a kernel change against the build before it on a noisy machine
(REV's entry points must take today's arguments).
Usage: python benchmarks/attention_layer.py [--batch 64] [--context 450] [--threads 2]
    [--dtype float32]
       [--kv-dtype float16] [--baseline REV]
"""

import argparse
import time

import torch

from decode_step import make_ctx  # benchmarks/ is sys.path[0] when run as a script
from revisions import REPO, load_at_revision
from tokenbus.model.attention import build_attention_plan, paged_attention
from tokenbus.model.native import load_paged_attention

ATTENTION_SOURCE = REPO / "src/tokenbus/model/native/paged_attention.c"

SUM_REFERENCE_NUMEL = 44_000_000  # fp32: 176 MB, far larger than the CPU caches
SUM_REPEATS = 5


def sum_bandwidth(repeats: int) -> float:
    """GB/s of a plain torch.sum over SUM_REFERENCE_NUMEL fp32 values, best of `repeats`."""
    x = torch.ones(SUM_REFERENCE_NUMEL, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.sum(x)
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best / 1e9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=450)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--baseline", metavar="REV", help="also git revision REV's paged_attention.c, in turns"
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="default: --dtype",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kv_dtype = getattr(torch, args.kv_dtype or args.dtype)
    g = torch.Generator().manual_seed(0)
    batch, context, bs, num_kv_heads, num_heads, head_dim = args.batch, args.context, 16, 3, 9, 64
    blocks_per_req = (context + bs) // bs
    num_blocks = batch * blocks_per_req + 1
    kv = torch.randn(2, num_blocks, bs, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    ctx = make_ctx([kv], batch, context, bs, g)
    slots = ctx.slot_mapping
    q = torch.randn(batch, num_heads + num_kv_heads, head_dim, generator=g).to(dtype)[:, :num_heads]
    k, v = (torch.randn(batch, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    kernels = [("torch", None), ("native", load_paged_attention())]
    if args.baseline:
        kernels.append(
            (
                f"native ({args.baseline})",
                load_at_revision(
                    args.baseline, ATTENTION_SOURCE, lambda path: load_paged_attention(source=path)
                ),
            )
        )
    plans = {name: build_attention_plan(ctx, dtype, kernel) for name, kernel in kernels}
    outputs, best = {}, {name: float("inf") for name in plans}
    for _ in range(args.repeats):  # round by round, so a slow spell of the machine slows every path
        for name, plan in plans.items():
            start = time.perf_counter()
            outputs[name] = paged_attention(q, k, v, kv, slots, plan, head_dim**-0.5)
            best[name] = min(best[name], time.perf_counter() - start)
    kv_bytes = 2 * batch * (context + 1) * num_kv_heads * head_dim * kv.element_size()
    for name, seconds in best.items():
        print(f"{name:7s} {seconds * 1e3:7.3f} ms  ({kv_bytes / seconds / 1e9:5.1f} GB/s of K/V)")
    for name in list(plans)[1:]:
        print(f"max |{name} - torch| = {(outputs[name] - outputs['torch']).abs().max().item():.2e}")
    print(
        f"reference: torch.sum over {SUM_REFERENCE_NUMEL * 4 / 1e6:.0f} MB fp32 "
        f"{sum_bandwidth(SUM_REPEATS):5.1f} GB/s (best of {SUM_REPEATS})"
    )


if __name__ == "__main__":
    main()
