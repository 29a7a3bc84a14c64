"""Structured output with drafts: one bitmask row per draft position, drafts cut to what the
grammar accepts, the matcher left where it was."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbus.core.request import Request
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.sampling_params import SamplingParams, StructuredOutputsParams
from tokenbus.structured.manager import StructuredOutputManager, bitmask_rows, pad_bitmask_rows

CHOICES = ["Paris is lovely", "London"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_models import smollm2_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))


@pytest.fixture
def manager(tokenizer):
    from tokenbus.structured.backend import XgrammarBackend

    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(
        lambda: XgrammarBackend.from_tokenizer(tokenizer, 49152, stop_token_ids=[eos])
    )
    yield manager
    manager.shutdown()


def _ready_request(manager) -> Request:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES))
    request = Request("r", [1, 2, 3], params)
    manager.add_request(request)
    manager._grammars["r"].future.result(timeout=60)
    assert manager.is_ready(request)
    return request


def _allowed(bitmask_row: np.ndarray, token_id: int) -> bool:
    return bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)


def test_validate_tokens_keeps_the_grammatical_prefix_and_rolls_back(manager, tokenizer):
    request = _ready_request(manager)
    paris = tokenizer.encode(CHOICES[0], add_special_tokens=False)
    assert len(paris) >= 3
    bad = tokenizer.encode(" zebra", add_special_tokens=False)
    assert manager.validate_tokens(request, paris[:2] + bad) == paris[:2]
    assert manager.validate_tokens(request, paris) == paris  # the matcher did not move
    assert manager.validate_tokens(request, bad) == []


def test_bitmask_has_a_row_per_draft_position(manager, tokenizer):
    request = _ready_request(manager)
    paris = tokenizer.encode(CHOICES[0], add_special_tokens=False)
    london = tokenizer.encode(CHOICES[1], add_special_tokens=False)
    drafts = paris[:2]
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"r": 1 + len(drafts)},
        total_num_scheduled_tokens=3,
        scheduled_spec_decode_tokens={"r": drafts},
    )
    request.num_computed_tokens = 2  # the scheduled chunk reaches the end of the known tokens
    manager.fill_bitmask(so, {"r": request})
    rows = bitmask_rows(so.grammar_bitmask)
    assert rows.shape[0] == 1 + len(drafts) and so.structured_output_request_ids == {"r": 0}
    assert _allowed(rows[0], paris[0]) and _allowed(rows[0], london[0])
    assert _allowed(rows[1], paris[1]) and not _allowed(rows[1], london[0])
    assert _allowed(rows[2], paris[2]) and not _allowed(rows[2], paris[0])
    # The matcher is back at the start: it still accepts either answer's first token.
    assert manager.validate_tokens(request, london[:1]) == london[:1]
    # The worker lines the rows up with its logits rows: 1 + drafts per constrained request,
    # one all-allowed row per position of an unconstrained one.
    full = pad_bitmask_rows(
        rows, so.structured_output_request_ids, ["x", "r"], rows.shape[1], [2, 3]
    )
    assert full.shape[0] == 5 and bool((full[:2] == -1).all())
    assert np.array_equal(full[2:].numpy(), rows)
