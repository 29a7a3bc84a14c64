"""Decode-step time of SmolLM2-135M on the CPU (--dtype, default fp32) with tokenbus' model +
paged attention.

Each of `batch` requests has `context` tokens in the paged cache (random K/V, shuffled blocks);
one step = model forward of `batch` single-token queries + compute_logits for those rows.
Usage: python benchmarks/decode_step.py [--batches 1 16 64] [--context 256] [--steps 10]
    [--dtype float32] [--profile]
"""

import argparse
import statistics
import time

import torch

from tokenbus.loader import load_arch, resolve_model
from tokenbus.model import ForwardContext
from tokenbus.model.kernel_plan import KernelRequest, apply_kernels
from tokenbus.model.layers.linear import LINEAR_BACKENDS
from tokenbus.worker.model_builder import load_model


def make_ctx(kv_caches, batch, context, block_size, generator):
    """`batch` decode requests of `context` cached tokens each, in shuffled blocks of the cache."""
    blocks_per_req = (context + 1 + block_size - 1) // block_size
    num_blocks = kv_caches[0].shape[1]
    perm = torch.randperm(num_blocks - 1, generator=generator)[: batch * blocks_per_req] + 1
    tables = perm.view(batch, blocks_per_req)
    pos = torch.full((batch,), context)
    slots = tables[:, context // block_size] * block_size + context % block_size
    seq = [context + 1] * batch
    return ForwardContext(
        positions=pos,
        slot_mapping=slots,
        kv_caches=kv_caches,
        block_size=block_size,
        query_start_loc=list(range(batch + 1)),
        seq_lens=seq,
        seq_lens_t=torch.tensor(seq),
        block_tables=tables,
        num_decodes=batch,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "native"])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--tile-mib", type=float, default=None, help="override attention.DECODE_TILE_BYTES"
    )
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time.process_time (CPU seconds; use with --threads 1 on a busy machine)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.tile_mib is not None:
        import tokenbus.model.attention as attention

        attention.DECODE_TILE_BYTES = int(args.tile_mib * 2**20)
    src = resolve_model(None)
    arch = load_arch(src)
    dtype = getattr(torch, args.dtype)
    model = load_model(src, arch, dtype, "cpu", args.attention_backend)  # linears "auto"
    if args.linear_backend != "auto":
        apply_kernels(model, KernelRequest(args.attention_backend, args.linear_backend))
    bs = args.block_size
    num_blocks = max(args.batches) * ((args.context + bs) // bs + 1) + 2
    g = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(2, num_blocks, bs, arch.num_key_value_heads, arch.head_dim, generator=g).to(
            dtype
        )
        for _ in range(arch.num_hidden_layers)
    ]
    for batch in args.batches:
        ctx = make_ctx(kv, batch, args.context, bs, g)
        ctx.attn_metadata = model.attention_backend.build_metadata(ctx)
        ids = torch.randint(0, arch.vocab_size, (batch,), generator=g)
        times = []
        with torch.inference_mode():
            for i in range(args.steps + 2):
                t = clock()
                model.compute_logits(model(ids, ctx))
                if i >= 2:
                    times.append(clock() - t)
            if args.profile:
                with torch.profiler.profile() as prof:
                    model.compute_logits(model(ids, ctx))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        med = statistics.median(times)
        print(
            f"batch {batch:3d} context {args.context}: step {med * 1e3:7.1f} ms "
            f"(min {min(times) * 1e3:.1f})  {batch / med:7.1f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
