"""Speculative sampling keeps the model's distribution, end to end: a tiny-vocabulary model
samples many continuations with and without drafts being verified, and the empirical
distribution of each verified position matches the exact one computed by transformers."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.oracle import load_hf
from tests.e2e.utils import assert_engine_clean
from tests.fixtures.tiny_models import cached_tiny_model
from tests.spec_decode.utils import damped_model, make_spec_llm, spec_metrics
from tokenbus import SamplingParams

VOCAB = 16
NUM_SAMPLES = 1500
# Every token of the vocabulary occurs, so a 1-gram lookup always finds a match.
PROMPT = [3, 9, 4, 12, 0, 7, 15, 1, 5, 11, 6, 2, 14, 8, 10, 13, 3, 9, 4, 12, 6, 2, 14]
# Chi-square critical values at significance 1e-4 by degrees of freedom (tables).
CHI2_CRITICAL = {
    df: v
    for df, v in zip(
        range(1, 16),
        (
            15.14,
            18.42,
            21.11,
            23.51,
            25.74,
            27.86,
            29.88,
            31.83,
            33.72,
            35.56,
            37.37,
            39.13,
            40.87,
            42.58,
            44.26,
        ),
    )
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    base = cached_tiny_model("llama", num_hidden_layers=4, vocab_size=VOCAB)
    return damped_model(base, tmp_path_factory.mktemp("spec-dist") / "m", num_full_layers=2)


def _exact_marginals(model_dir, num_positions: int, temperature: float) -> list[torch.Tensor]:
    """P(token at position j of the output), j < num_positions, by enumerating all prefixes."""
    hf = load_hf(str(model_dir))
    prefixes, prefix_probs = (
        [[]],
        torch.ones(1, dtype=torch.float64),
    )  # [P] probability of each prefix
    marginals = []
    for _ in range(num_positions):
        inputs = torch.tensor([PROMPT + p for p in prefixes])  # [P, len]
        with torch.inference_mode():
            next_probs = (hf(inputs).logits[:, -1].double() / temperature).softmax(-1)  # [P, V]
        joint = prefix_probs[:, None] * next_probs  # [P, V]
        marginals.append(joint.sum(0))
        prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
        prefix_probs = joint.flatten()  # [P * V], the order of `prefixes`
    return marginals


def _chi_square_ok(tokens: list[int], probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value); bins expected below 5 are pooled into one."""
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probs * len(tokens)
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return statistic, CHI2_CRITICAL[len(counts) - 1]


@pytest.mark.parametrize(
    "spec",
    [
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        {"method": "draft_model", "draft_layers": 2, "num_speculative_tokens": 3},
    ],
    ids=["ngram", "self_draft"],
)
def test_speculative_sampling_preserves_the_model_distribution(model_dir, spec):
    num_positions, temperature = 4, 0.6
    llm = make_spec_llm(model_dir, spec, max_model_len=64, num_kv_blocks=512, max_num_seqs=256)
    params = SamplingParams(
        n=NUM_SAMPLES, temperature=temperature, max_tokens=num_positions + 1, ignore_eos=True
    )
    with spec_metrics(llm) as metrics:
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    # Drafts really were verified, and both verdicts occurred often.
    assert (
        NUM_SAMPLES // 5 < metrics.num_accepted_tokens < metrics.num_draft_tokens - NUM_SAMPLES // 5
    ), metrics
    exact = _exact_marginals(model_dir, num_positions, temperature)
    # Position 0 is sampled after the prompt (no drafts); later ones come out of verification.
    for j in range(num_positions):
        statistic, critical = _chi_square_ok([c.token_ids[j] for c in out.outputs], exact[j])
        assert statistic < critical, (j, statistic, critical)
    assert_engine_clean(llm)
