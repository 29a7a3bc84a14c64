"""The Triton MoE step (model/triton_moe.py): pairs grouped by expert with exact slots, and the
grouped GEMMs against the experts run one by one (model/moe.py's portable path), on a GPU or
in Triton's interpreter (tests/fixtures/triton_device.py)."""

import pytest
import torch
from tests.fixtures.triton_device import (
    BF16_DOT_ON_GPU_ONLY,
    DEVICE,
    skip_module_without_triton,
)

skip_module_without_triton()

from tests.fixtures.host_reads import HostReads  # noqa: E402
from tests.fixtures.tiny_models import TINY_QWEN3_MOE, cached_tiny_model  # noqa: E402

from tokenbus.loader import load_arch, resolve_model  # noqa: E402
from tokenbus.model import triton_moe  # noqa: E402  (after the interpreter check)
from tokenbus.model.layers import TORCH_OPS  # noqa: E402
from tokenbus.model.moe import SparseMoeBlock  # noqa: E402
from tokenbus.model.parallel import TensorParallel  # noqa: E402

# Pairs p = t * k + j of 3 tokens, 2 experts each: token 0 -> experts 2, 0; 1 -> 0, 1; 2 -> 2, 0.
EXPERT_IDS = [[2, 0], [0, 1], [2, 0]]


def test_pairs_are_grouped_by_expert_in_padded_blocks():
    blocks = triton_moe.align_pairs(torch.tensor(EXPERT_IDS), 0, 3, block_m=4)
    none = 6  # the padding id: the number of pairs
    # Expert 0 has pairs 1, 2, 5; expert 1 pair 3; expert 2 pairs 0, 4, each run padded to 4.
    # Slots: 6 pairs + 3 experts * 3 padding at most = 15, rounded up to whole blocks: 16.
    assert blocks.pairs.tolist() == [1, 2, 5, none, 3, none, none, none, 0, 4] + [none] * 6
    assert blocks.block_experts.tolist() == [0, 1, 2, 2]  # the idle last block: clamped
    assert blocks.num_padded.tolist() == [12]
    assert (blocks.num_pairs, blocks.block_m) == (6, 4)


def test_other_ranks_experts_are_never_placed():
    # This rank holds experts 1 and 2 (local 0 and 1): expert 0's pairs 1, 2 and 5 stay out.
    blocks = triton_moe.align_pairs(torch.tensor(EXPERT_IDS), 1, 2, block_m=4)
    assert blocks.pairs.tolist() == [3, 6, 6, 6, 0, 4, 6, 6, 6, 6, 6, 6]
    assert blocks.block_experts.tolist() == [0, 1, 1]
    assert blocks.num_padded.tolist() == [8]


def _block(rank=0, size=1, dtype=torch.float32, seed=0):
    """A Qwen3-MoE block (8 experts, 2 per token) with random weights, on DEVICE."""
    arch = load_arch(resolve_model(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE))))
    block = SparseMoeBlock(arch, TensorParallel(rank=rank, size=size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block.to(DEVICE, dtype), arch


@pytest.mark.parametrize("num_tokens", [1, 5, 37])  # decode-sized blocks of 16, prefill of 64
def test_grouped_gemms_equal_the_experts_one_by_one(num_tokens):
    block, arch = _block()
    x = torch.randn(num_tokens, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(DEVICE)
    with torch.no_grad():
        want = block(x)
        gate_up = block.experts[3].gate_up_proj
        block.stack_experts()
        assert block.stacked[0].shape == (8, 2 * arch.moe_intermediate_size, arch.hidden_size)
        assert block.stacked[1].shape == (8, arch.hidden_size, arch.moe_intermediate_size)
        # one copy: each expert's linear now views its slice of the stacked tensor
        assert gate_up.weight.data_ptr() == block.stacked[0][3].data_ptr()
        got = block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_stacked_block_reads_nothing_back():
    """What a CUDA graph needs of the step, checked on CPU (tests/fixtures/host_reads.py):
    the experts run one by one read their counts back (bincount, tolist); stacked, the
    routing, grouping and GEMMs read nothing."""
    block, arch = _block()
    x = torch.randn(5, arch.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        with HostReads() as reads:
            block(x)
        assert reads.ops == ["bincount", "tolist"]
        block.stack_experts()
        with HostReads() as reads:
            block(x)
        assert reads.ops == []


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_ON_GPU_ONLY)]
)
def test_half_precision_experts_stay_close(dtype):
    block, arch = _block(dtype=dtype)
    x = torch.randn(9, arch.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x.to(DEVICE, dtype)
    with torch.no_grad():
        want = block(x).float()
        block.stack_experts()
        got = block(x).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_expert_parallel_ranks_sum_to_the_whole_block():
    """Each rank runs only its experts and leaves the others' rows at zero: the two partial
    outputs (what the all-reduce sums) add up to the single-rank block's output."""
    whole, arch = _block()
    x = torch.randn(11, arch.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    halves = []
    for rank in range(2):
        half, _ = _block(rank=rank, size=2)
        # the same weights as the whole block: the router, and this rank's four experts
        half.gate.load_state_dict(whole.gate.state_dict())
        for local, expert in enumerate(half.experts):
            expert.load_state_dict(whole.experts[half.first_expert + local].state_dict())
        half.stack_experts()
        halves.append(half)
    with torch.no_grad():
        want = whole(x)
        # the all-reduce of size 2 needs a process group: call the experts' step directly
        parts = []
        for half in halves:
            weights, expert_ids = half.route(x)
            parts.append(
                triton_moe.fused_experts(
                    x,
                    *half.stacked,
                    weights,
                    expert_ids,
                    half.ops.silu_mul,
                    first_expert=half.first_expert,
                    some_experts_elsewhere=True,
                )  # fmt: skip
            )
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)


def test_converting_a_stacked_block_stacks_its_converted_weights():
    """.to() & co convert each expert's weight on its own: the block stacks them again, so the
    GEMMs run the converted weights and each expert still views its slice."""
    block, _ = _block()
    block.stack_experts()
    block.half()
    assert block.stacked[0].dtype == block.stacked[1].dtype == torch.float16
    for e, expert in enumerate(block.experts):
        assert expert.gate_up_proj.weight.data_ptr() == block.stacked[0][e].data_ptr()
        assert expert.down_proj.weight.data_ptr() == block.stacked[1][e].data_ptr()


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="a real-size layer in the interpreter takes minutes")
@pytest.mark.parametrize("num_tokens", [1, 64, 300])  # decode, a decode batch, a prefill chunk
def test_a_qwen3_30b_a3b_layer_on_the_gpu(num_tokens):
    """Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, 8 a token) in bf16,
    every tile edge at its real place, against each pair computed in fp32 from the same
    weights."""
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, **bf16) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen, **bf16) * inter**-0.5
    x = torch.randn(num_tokens, hidden, generator=gen, **bf16)
    logits = torch.randn(num_tokens, experts, generator=gen, device=DEVICE)
    routing, ids = logits.softmax(-1).topk(top_k, dim=-1)
    routing = (routing / routing.sum(-1, keepdim=True)).to(torch.bfloat16)
    silu_mul = TORCH_OPS.silu_mul
    got = triton_moe.fused_experts(x, gate_up, down, routing, ids, silu_mul).float()
    want = torch.zeros(num_tokens, hidden, device=DEVICE)
    for j in range(top_k):
        w13, w2 = gate_up[ids[:, j]].float(), down[ids[:, j]].float()  # [T, 2I, H], [T, H, I]
        h = silu_mul(torch.bmm(w13, x.float().unsqueeze(-1)).squeeze(-1))
        want += routing[:, j, None].float() * torch.bmm(w2, h.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
