"""Structured output inside the EngineCore: compile off the step loop, one bitmask per step (L2).

Implements `core.sched.ports.GrammarManager`. Grammars compile in a thread pool while their
requests wait in WAITING_FOR_GRAMMAR; others keep running. Each step, the constrained requests
that sample get one bitmask row each (1 + drafts rows with speculative decoding); the matcher
advances on every accepted token.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.sched.output import GrammarBitmask, SchedulerOutput
from tokenbus.utils.log import log_safe

if TYPE_CHECKING:  # xgrammar (slow to import) loads with the first grammar: backend.py
    import xgrammar as xgr

    from tokenbus.structured.backend import XgrammarBackend

logger = logging.getLogger(__name__)


@dataclass
class RequestGrammar:
    future: concurrent.futures.Future
    matcher: xgr.GrammarMatcher | None = None
    error: str | None = None


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], XgrammarBackend]) -> None:
        self._make_backend = make_backend
        self._backend: XgrammarBackend | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="grammar"
        )
        self._grammars: dict[str, RequestGrammar] = {}

    def _get_backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    # -- GrammarManager port --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        future = self._pool.submit(lambda: self._get_backend().compile(spec))
        self._grammars[request.request_id] = RequestGrammar(future)

    def is_ready(self, request: Request) -> bool:
        """True once compiled; a failed compile finishes the request with an error."""
        grammar = self._grammars[request.request_id]
        if not grammar.future.done():
            return False
        if grammar.matcher is None and grammar.error is None:
            try:
                compiled = grammar.future.result()
                grammar.matcher = self._get_backend().new_matcher(compiled)
            except Exception as exc:  # noqa: BLE001 - any compile failure ends this request only
                grammar.error = str(exc)
                logger.warning(
                    "grammar for %s failed to compile: %s",
                    log_safe(request.request_id, 100),
                    log_safe(exc),
                )
                request.status = RequestStatus.FINISHED_ERROR
        return True

    def fill_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """One row per sampled position: 1 + drafts rows for a request verifying drafts."""
        first_rows: dict[str, int] = {}
        plans: list[tuple[xgr.GrammarMatcher, list[int], int]] = []  # matcher, drafts, first row
        num_rows = 0
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            grammar = self._grammars.get(req_id)
            request = requests[req_id]
            # Only a chunk that reaches the end of the known tokens samples (this runs before
            # num_computed_tokens advances).
            if (
                grammar is None
                or grammar.matcher is None
                or (request.num_computed_tokens + num_new < request.num_tokens)
            ):
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            first_rows[req_id] = num_rows
            plans.append((grammar.matcher, drafts, num_rows))
            num_rows += 1 + len(drafts)
        if not plans:
            return
        bitmask = torch.full((num_rows, self._get_backend().bitmask_width), -1, dtype=torch.int32)
        for matcher, drafts, first_row in plans:
            _fill_rows(matcher, drafts, bitmask, first_row)
        scheduler_output.structured_output_request_ids = first_rows
        scheduler_output.grammar_bitmask = GrammarBitmask(bitmask.numpy().tobytes(), *bitmask.shape)

    def validate_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (drafts) the request's grammar accepts next."""
        grammar = self._grammars.get(request.request_id)
        if grammar is None or grammar.matcher is None or not token_ids:
            return token_ids
        num_valid = 0
        for token_id in token_ids:
            if grammar.matcher.is_terminated() or not grammar.matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            grammar.matcher.rollback(num_valid)
        return token_ids[:num_valid]

    def accept_tokens(self, request: Request, token_ids: list[int]) -> None:
        grammar = self._grammars.get(request.request_id)
        if grammar is None or grammar.matcher is None:
            return
        for token_id in token_ids:
            if grammar.matcher.is_terminated():
                break
            if not grammar.matcher.accept_token(token_id):
                logger.warning(
                    "grammar rejected token %d of %s", token_id, log_safe(request.request_id, 100)
                )
                if not request.is_finished:
                    request.status = RequestStatus.FINISHED_ERROR
                return

    def remove_request(self, request: Request) -> None:
        grammar = self._grammars.pop(request.request_id, None)
        if grammar is not None:
            grammar.future.cancel()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _fill_rows(
    matcher: xgr.GrammarMatcher, drafts: list[int], bitmask: torch.Tensor, first_row: int
) -> None:
    """Row first_row + j: the mask after the first j drafts. The matcher advances over the
    drafts to fill the rows, then rolls back. After a draft the grammar rejects (drafts are
    validated, so only through a race) later rows repeat the last row: verification stops at
    that draft anyway. Rows after the matcher terminated stay all-allowed."""
    num_advanced = 0
    for j in range(len(drafts) + 1):
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if j == len(drafts) or not matcher.accept_token(drafts[j]):
            bitmask[first_row + j + 1 : first_row + len(drafts) + 1] = bitmask[first_row + j]
            break
        num_advanced += 1
    if num_advanced:
        matcher.rollback(num_advanced)


def bitmask_rows(mask: GrammarBitmask) -> np.ndarray:
    """The int32 [num_rows, num_words] array a GrammarBitmask carries (a view of its bytes)."""
    return np.frombuffer(mask.data, dtype=np.int32).reshape(mask.num_rows, mask.num_words)


def pad_bitmask_rows(
    bitmask: np.ndarray | None,
    row_of: dict[str, int],
    req_ids: list[str],
    width: int,
    num_rows: list[int],
) -> torch.Tensor | None:
    """Grow the constrained rows to all sampled rows: `num_rows[i]` consecutive rows for
    request i (1 + its drafts). Unconstrained rows allow all."""
    if bitmask is None:
        return None
    full = torch.full((sum(num_rows), width), -1, dtype=torch.int32)
    out_row = 0
    for req_id, count in zip(req_ids, num_rows):
        row = row_of.get(req_id)
        if row is not None:
            # a copy: may be read-only
            full[out_row : out_row + count] = torch.tensor(bitmask[row : row + count])
        out_row += count
    return full
