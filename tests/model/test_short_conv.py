"""LFM2's short convolution (model/short_conv.py, model/recurrent.py) on mixed steps against one
causal Conv1d over each request's whole sequence, and its state rows (worker/state_pool.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.recurrent import RecurrentPlan
from tokenbus.model.short_conv import ShortConv
from tokenbus.model_arch import ModelArch
from tokenbus.worker.state_pool import RequestStates

HIDDEN = 8


def _conv(kernel: int, bias: bool) -> ShortConv:
    arch = ModelArch(
        architecture="lfm2",
        vocab_size=16,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=64,
        recurrent_layers=(0,),
        conv_kernel=kernel,
        conv_bias=bias,
    )
    conv = ShortConv(arch)
    generator = torch.Generator().manual_seed(kernel)
    with torch.no_grad():
        for param in conv.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    conv.in_proj.finalize("dense")
    conv.out_proj.finalize("dense")
    return conv


def _reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """HF's Lfm2ShortConv over one whole sequence x [L, H]: Conv1d with K - 1 zeros of padding,
    cut to L."""
    b, c, u = conv.in_proj(x).split(HIDDEN, dim=-1)
    bx = (b * u).t()[None]  # [1, H, L]
    out = F.conv1d(bx, conv.weight[:, None], conv.bias, padding=conv.kernel - 1, groups=HIDDEN)
    return conv.out_proj(c * out[0, :, : x.shape[0]].t())


def _step(conv, state, rows, chunks):
    """One step of `chunks` (a [q, H] input per request, rows[i] its state row)."""
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + chunk.shape[0])
    ctx = ForwardContext(
        positions=torch.zeros(starts[-1], dtype=torch.int64),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        kv_caches=[state],
        block_size=16,
        query_start_loc=starts,
        seq_lens=[1] * len(chunks),
        seq_lens_t=torch.ones(len(chunks), dtype=torch.int64),
        block_tables=torch.zeros(len(chunks), 1, dtype=torch.int64),
        num_decodes=0,
        recurrent_layers=frozenset({0}),
        state_rows=torch.tensor(rows, dtype=torch.int64),
    )
    plan = RecurrentPlan.build(ctx, conv.kernel)
    return conv(torch.cat(chunks), None, None, state, plan.rows, plan)


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_steps_of_any_mix_equal_one_pass_over_each_sequence(kernel, bias):
    """Four requests cut into decodes and chunks shorter and longer than the kernel, in
    different rows, batched together: each token's output is the whole-sequence conv's, and
    the rows of other requests are left alone."""
    torch.manual_seed(0)
    conv = _conv(kernel, bias)
    lengths = [1, 2, 9, 6]
    seqs = [torch.randn(n + 3, HIDDEN) for n in lengths]  # then three decodes each
    rows = [3, 0, 5, 1]  # pool rows, not in batch order
    state = torch.zeros(6, kernel - 1, HIDDEN)
    state[[2, 4]] = 7.0  # rows nobody holds
    with torch.inference_mode():
        want = [_reference(conv, seq) for seq in seqs]
        got: list[list[torch.Tensor]] = [[] for _ in seqs]
        done = [0] * len(seqs)
        # chunks of these sizes per step (0: not scheduled), then the decodes all together
        plan = [[1, 1, 4, 2], [0, 1, 1, 3], [0, 0, 4, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
        for sizes in plan:
            active = [i for i, n in enumerate(sizes) if n]
            chunks = [seqs[i][done[i] : done[i] + sizes[i]] for i in active]
            out = _step(conv, state, [rows[i] for i in active], chunks)
            for i, piece in zip(active, out.split([sizes[i] for i in active])):
                got[i].append(piece)
                done[i] += sizes[i]
    assert done == [n + 3 for n in lengths]
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(torch.cat(ours), theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[[2, 4]], torch.full((2, kernel - 1, HIDDEN), 7.0))


def test_state_rows_are_zeroed_when_taken_and_given_back():
    pools = [torch.ones(3, 2, 4), torch.ones(3, 2, 4)]
    states = RequestStates(pools)
    assert [states.start("a"), states.start("b")] == [0, 1]
    assert all(pool[:2].eq(0).all() and pool[2].eq(1).all() for pool in pools)
    states.release("a")
    states.release("never-started")  # finished before it ran: nothing to give back
    pools[0][0] = 5.0  # what the last holder left
    assert states.start("c") == 0 and pools[0][0].eq(0).all()
    assert states.start("d") == 2
    with pytest.raises(RuntimeError, match="no recurrent-state row is free"):
        states.start("e")
    with pytest.raises(RuntimeError, match="already holds state row"):
        states.start("b")
    assert states.held_rows == {"b": 1, "c": 0, "d": 2}
