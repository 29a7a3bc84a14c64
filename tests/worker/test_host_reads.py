"""The device half of sampling reads nothing back to the host, checked on CPU.

On a GPU, tests/worker/test_cuda_graphs.py counts a step's synchronizing calls under torch's
sync debug mode. Here tests/fixtures/host_reads.py names the ops that would wait there: scalar
reads and outputs sized by the data. The vocabulary is kept under top-p's 1024-candidate
shortcut, so the CPU path is the one a GPU takes (on CPU, a larger vocabulary may check on the
host which rows the candidates did not cover: nothing waits for it there).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.utils import make_llm
from tests.fixtures.host_reads import HostReads
from tests.fixtures.step_reads import (
    COUNTED_STEPS,
    NGRAM,
    SELF_DRAFT,
    count_warm_steps,
    motif_prompts,
)
from tests.fixtures.tiny_models import TINY_QWEN3_MOE, cached_tiny_model
from tests.fixtures.triton_device import needs_triton_on_cpu, stack_moe_blocks
from tokenbus.sampling_params import SamplingParams
from tokenbus.worker.model_runner import ModelRunner
from tokenbus.worker.sampler import Sampler
from tokenbus.worker.sampling_metadata import SamplingMetadata, SamplingRow
from tokenbus.worker.spec_decode.metadata import SpecDecodeMetadata, expand_sampling_rows
from tokenbus.worker.spec_decode.rejection_sampler import RejectionSampler

VOCAB = 512
EVERYTHING = dict(
    temperature=0.8,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    logit_bias={7: 2.0},
    min_tokens=4,
    logprobs=2,
)


def _rows(seed: int | None = None) -> list[SamplingRow]:
    """A greedy row with logprobs, and a random row using every sampling setting (seeded: its
    own generator)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=3), [1, 2, 3], [4, 5]),
        SamplingRow(
            SamplingParams(seed=seed, **EVERYTHING), [1, 2, 3], [9], generator,
            stop_ids_for_min_tokens=[0],
        ),
    ]  # fmt: skip


X = torch.randn(6, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "read, names",
    [
        (lambda: X.argmax().item(), ["_local_scalar_dense"]),
        (lambda: X.tolist(), ["tolist"]),
        (lambda: bool(X.sum() > 0), ["_local_scalar_dense"]),
        (lambda: X[X > 0], ["index"]),
        (lambda: X.nonzero(), ["nonzero"]),
        (lambda: torch.bincount(X.long().abs()), ["bincount"]),
        (lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])), ["repeat_interleave"]),
        (lambda: torch.equal(X, X), ["equal"]),
        (lambda: torch.multinomial(X.abs(), 1), ["multinomial"]),
        (lambda: X.cpu(), ["cpu"]),
        (lambda: torch.where(X > 0, X, 0.0).topk(2), []),
        (lambda: X[torch.tensor([0, 2])].argsort(stable=True), []),
        (lambda: X.clone().__setitem__(X > 0, 0.0), []),  # lowered to masked_fill
    ],
)
def test_the_reads_are_named(read, names):
    with HostReads() as reads:
        read()
    assert reads.ops == names


@pytest.mark.parametrize("seed", [None, 7])
def test_sampling_reads_nothing_back(seed):
    """Every setting, a seeded row, and a grammar's bitmask on the random row."""
    meta = SamplingMetadata.build(_rows(seed), VOCAB, "cpu")
    meta.grammar_bitmask = torch.full((2, VOCAB // 32), -1, dtype=torch.int32)
    meta.grammar_bitmask[1, : VOCAB // 64] = 0  # the first half of the vocabulary disallowed
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    with HostReads() as reads:
        out = Sampler(torch.Generator().manual_seed(2))(logits, meta)
    assert reads.ops == []
    assert out.sampled_token_ids.shape == (2,) and out.logprobs.token_ids.shape == (2, 4)
    assert out.sampled_token_ids[1] >= VOCAB // 2


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_draft_verification_reads_once(with_draft_probs):
    """Greedy and random requests, the last without drafts (its draft start is D): the device
    half reads nothing; the whole verification reads once, the counts and tokens together."""
    drafts = [[3, 4, 5], [6, 7], []]
    rows = _rows() + [SamplingRow(SamplingParams(temperature=1.0), [1], [])]
    expanded = expand_sampling_rows(rows, drafts)
    meta = SamplingMetadata.build(expanded, VOCAB, "cpu")
    gen = torch.Generator().manual_seed(3)
    draft_probs = torch.rand(5, VOCAB, generator=gen).softmax(-1) if with_draft_probs else None
    spec = SpecDecodeMetadata.build(drafts, "cpu", draft_probs)
    logits = torch.randn(len(expanded), VOCAB, generator=gen)
    sampler = RejectionSampler(torch.Generator().manual_seed(4))
    with HostReads() as reads:
        sampler.verify(logits.clone(), meta, spec)
    assert reads.ops == []
    with HostReads() as reads:
        out = sampler(logits.clone(), meta, spec)
    assert reads.ops == ["tolist"]
    assert [len(tokens) for tokens in out.token_ids] == [a + 1 for a in out.num_accepted]


@needs_triton_on_cpu
@pytest.mark.parametrize(
    "family, speculative, reads_a_step",
    [
        pytest.param("llama", None, 1, id="llama"),
        pytest.param("llama", NGRAM, 1, id="ngram"),
        pytest.param("llama", SELF_DRAFT, 2, id="self_draft", marks=pytest.mark.slow),
        pytest.param("qwen3_moe", None, 1, id="qwen3_moe", marks=pytest.mark.slow),
    ],
)
def test_an_eager_triton_step_reads_once(family, speculative, reads_a_step):
    """A GPU's eager step, run on CPU: the step's inputs, the Triton attention plan and
    kernels (in the interpreter), the forward (an MoE's experts stacked, as on a GPU), and
    sampling or draft verification, for greedy and sampled rows together, read back one
    thing a step: the sampled ids, or the accepted counts and tokens. A draft model's k
    drafts, made by a catch-up pass and k - 1 decode passes, come back in one more read.
    (Where the CPU and GPU paths differ, the linears' and norms' kernels and pinned staging,
    the CPU's runs here.)"""
    model = cached_tiny_model(family, **TINY_QWEN3_MOE if family == "qwen3_moe" else {})
    llm = make_llm(
        model, device="cpu", dtype="float32", attention_backend="triton",
        enforce_eager=True, max_num_seqs=8, max_model_len=256,
        speculative_config=speculative,
    )  # fmt: skip
    try:
        stack_moe_blocks(llm.engine.client.engine_core.executor.worker.model)
        reads, metrics = count_warm_steps(
            llm, motif_prompts(), warm_steps=4, counter=HostReads(), max_tokens=30
        )
        assert reads == ["tolist"] * (reads_a_step * COUNTED_STEPS)
        assert (metrics.num_draft_tokens > 0) == (speculative is not None)
    finally:
        llm.shutdown()


@needs_triton_on_cpu
def test_a_step_launched_ahead_reads_nothing_before_its_result(monkeypatch):
    """Async scheduling: launching a step (decodes fed the last step's unread tokens on the
    device) reads nothing back; each step's one read comes with its result, after the next
    step was launched."""
    llm = make_llm(
        cached_tiny_model("llama"), device="cpu", dtype="float32", attention_backend="triton",
        enforce_eager=True, max_num_seqs=8, max_model_len=256, async_scheduling=True,
    )  # fmt: skip
    launch_reads: list[str] = []
    fed: list[int] = []
    launch = ModelRunner.launch

    def counted_launch(runner, so):
        with HostReads() as reads:
            pending = launch(runner, so)
        launch_reads.extend(reads.ops)
        batch = getattr(pending, "batch", None)  # None: an empty step
        fed.append(len(batch.unread_inputs) if batch is not None else 0)
        return pending

    monkeypatch.setattr(ModelRunner, "launch", counted_launch)
    try:
        reads, _ = count_warm_steps(
            llm, motif_prompts(), warm_steps=4, counter=HostReads(), max_tokens=30
        )
        assert reads == ["tolist"] * COUNTED_STEPS
        assert launch_reads == []
        assert max(fed) == len(motif_prompts())  # every decode fed an unread token
    finally:
        llm.shutdown()
