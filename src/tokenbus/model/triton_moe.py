"""A mixture-of-experts step in Triton with no host sync (L2): what lets MoE models be captured.

model/moe.py's portable path reads each expert's token count on the host to slice its rows, so
the step waits on the device once per layer and cannot be recorded in a CUDA graph. Here the
(token, expert) pairs are grouped by expert on the device, into a buffer whose size depends only
on the token count, and one kernel runs every expert's GEMM at once (vLLM's fused_moe, its
moe_align_block_size and the Triton GEMM, organised our own way):

1. `align_pairs`: pair p = t * k + j is token t's j-th expert. The pairs are sorted by expert
   (stable, so each run holds its tokens ascending) and each expert's run is padded to a
   multiple of BLOCK_M with the id `num_pairs` (no pair). A block of BLOCK_M consecutive slots
   then belongs to one expert (`block_experts`). With P pairs and E experts the padded runs
   take at most P + min(E, P) * (BLOCK_M - 1) slots: the buffers are that size, and the true
   total (`num_padded`, a device scalar) tells the kernel which blocks are idle.
2. `_expert_gemm_kernel`, a grid of (block, N tile): each program loads its expert's weight
   tile once for its BLOCK_M rows. Run twice: gate_up over the tokens' hidden states (row of
   pair p: token p // k) into [P, 2I]; then, after silu(gate) * up, down over those rows (row
   of pair p: p) into [P, hidden], each row times its routing weight.
3. The k rows of each token are summed. The pairs of a token are ordered by expert id first,
   so the sum is taken in ascending expert order, HF's (its index_add_ over experts). In fp32
   the result is model/moe.py's up to the GEMMs' summation order; in bf16 and fp16 it agrees
   to rounding: each pair's row is rounded once (after its routing weight scaled the fp32
   accumulator) and the sum of a token's k rows once more, where the per-expert path rounds
   the product and then each add.

Expert parallel (tensor_parallel_size > 1): a rank holds experts [first, first + E); pairs of
other ranks' experts are never placed, their rows stay zero, and the caller's all-reduce sums
the ranks as before.

Weights are HF's stacked layout ([E, 2I, hidden] and [E, hidden, I]), dense (fp32, fp16,
bf16); GGUF blocks run the portable path on CPU. The kernels run on CUDA, and on CPU tensors
under TRITON_INTERPRET=1 (how the test suite checks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # [rows, K]: hidden states (ROWS_PER_PAIR k) or the pairs' activations (1)
    w_ptr,  # [E, N, K]: the experts' weights, HF layout (out, in)
    c_ptr,  # [P, N]: row p is pair p's output
    routing_ptr,  # [P]: each pair's routing weight (read when ROUTED)
    pairs_ptr,  # [max_padded]: pair ids grouped by expert; num_pairs marks padding
    block_experts_ptr,  # [max_padded // BLOCK_M]: the (local) expert of each block
    num_padded_ptr,  # [1]: slots the padded runs take; blocks from there on are idle
    num_pairs,
    N,
    K,
    stride_a,
    stride_w_expert,
    stride_w_n,
    stride_c,
    ROWS_PER_PAIR: tl.constexpr,  # pair p reads row p // ROWS_PER_PAIR of a
    ROUTED: tl.constexpr,
    FP32_DOT: tl.constexpr,  # fp32 weights: an IEEE dot, not TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    tile_n = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    real = pairs < num_pairs
    rows = pairs // ROWS_PER_PAIR
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_base = w_ptr + expert * stride_w_expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + k[None, :],
            mask=real[:, None] & k_mask[None, :],
            other=0.0,
        )
        # [BLOCK_K, BLOCK_N]: the transposed tile of W[expert] (out rows n, in columns k)
        w = tl.load(
            w_base + n[None, :] * stride_w_n + k[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if FP32_DOT:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if ROUTED:
        weight = tl.load(routing_ptr + pairs, mask=real, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    tl.store(
        c_ptr + pairs[:, None] * stride_c + n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=real[:, None] & n_mask[None, :],
    )


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one step's expert GEMMs (vLLM's defaults for an untuned shape)."""

    block_m: int
    block_n: int
    block_k: int

    @classmethod
    def for_step(cls, num_tokens: int, num_experts: int) -> GemmConfig:
        # Few tokens per expert (decodes): short blocks waste less padding; many: larger
        # tiles reuse each loaded weight tile over more rows.
        if num_tokens <= num_experts:
            return cls(16, 32, 64)
        return cls(64, 64, 32)


@dataclass(frozen=True)
class PairBlocks:
    """The pairs of one step grouped by expert in blocks of `block_m` slots (align_pairs)."""

    pairs: torch.Tensor  # [max_padded] int64; `num_pairs` in a padding slot
    block_experts: torch.Tensor  # [max_padded // block_m] int64, the local expert per block
    num_padded: torch.Tensor  # [1] int64
    num_pairs: int
    block_m: int


def align_pairs(
    expert_ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int
) -> PairBlocks:
    """Group the pairs of expert_ids [T, k] (global ids) by this rank's experts
    [first_expert, first_expert + num_experts), each expert's run padded to block_m slots.

    Only device ops whose output sizes follow from T: nothing is read back to the host."""
    device = expert_ids.device
    num_pairs = expert_ids.numel()
    local = expert_ids.flatten().to(torch.int64) - first_expert
    # Other ranks' experts share one extra bucket, E, which is sorted last and never placed.
    bucket = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(bucket, stable=True)  # pair ids, grouped by bucket, ascending within
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    run_start = torch.cumsum(counts, 0) - counts  # each bucket's first index in `order`
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    # Slot of the i-th pair in `order`: its expert's padded start plus its rank in the run;
    # pairs of the extra bucket go to one dump slot past the end, then cut off.
    slot_start = torch.cat([padded_end - padded, padded_end.new_full((1,), max_padded)])
    sorted_bucket = bucket[order]
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_bucket]
    slots = torch.where(sorted_bucket < num_experts, slot_start[sorted_bucket] + rank, max_padded)
    pairs = torch.full((max_padded + 1,), num_pairs, dtype=torch.int64, device=device)
    pairs[slots] = order
    # Block b starts at slot b * block_m: its expert is the first whose padded run ends past
    # that. Blocks past the total find none (num_experts); they are idle, so clamp the id.
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return PairBlocks(
        pairs[:max_padded],
        block_experts.clamp_(max=num_experts - 1),
        padded_end[-1:],
        num_pairs,
        block_m,
    )


def expert_gemm(
    a: torch.Tensor,
    weights: torch.Tensor,
    blocks: PairBlocks,
    config: GemmConfig,
    out: torch.Tensor,
    rows_per_pair: int,
    routing: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = a[p // rows_per_pair] @ weights[expert of p].T (times routing[p], if given),
    for every placed pair p; other rows of out are left as they were."""
    num_experts, n, k = weights.shape
    if a.stride(-1) != 1 or weights.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("expert_gemm needs rows with unit stride")
    grid = (blocks.pairs.numel() // blocks.block_m, triton.cdiv(n, config.block_n))
    _expert_gemm_kernel[grid](
        a,
        weights,
        out,
        routing if routing is not None else out,
        blocks.pairs,
        blocks.block_experts,
        blocks.num_padded,
        blocks.num_pairs,
        n,
        k,
        a.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        ROWS_PER_PAIR=rows_per_pair,
        ROUTED=routing is not None,
        FP32_DOT=weights.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
    )
    return out


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing: torch.Tensor,
    expert_ids: torch.Tensor,
    silu_mul,
    first_expert: int = 0,
    some_experts_elsewhere: bool = False,
) -> torch.Tensor:
    """x [T, hidden] through its routed experts -> [T, hidden]: gate_up [E, 2I, hidden] and
    down [E, hidden, I] are this rank's experts (global ids first_expert ...), routing and
    expert_ids [T, k] each token's weights and experts, silu_mul [.., 2I] -> [.., I].
    `some_experts_elsewhere`: expert parallel, other ranks hold experts too."""
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_up.shape[0]
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    # Each token's experts in ascending id: its k output rows are then summed in HF's order.
    expert_ids, by_id = torch.sort(expert_ids, dim=-1)
    routing = routing.gather(-1, by_id)
    config = GemmConfig.for_step(num_tokens, num_experts)
    blocks = align_pairs(expert_ids, first_expert, num_experts, config.block_m)
    num_pairs = num_tokens * top_k
    hidden = x.new_empty(num_pairs, gate_up.shape[1])
    expert_gemm(x.contiguous(), gate_up, blocks, config, hidden, rows_per_pair=top_k)
    act = silu_mul(hidden)  # [P, I]
    # Rows of pairs this rank does not run are never written: zero, when there can be any.
    make = x.new_zeros if some_experts_elsewhere else x.new_empty
    out = make(num_pairs, down.shape[1])
    expert_gemm(act, down, blocks, config, out, rows_per_pair=1, routing=routing.flatten())
    return out.view(num_tokens, top_k, -1).sum(dim=1)
