"""Structured output inside the EngineCore: compile off the step loop, one bitmask per step (L2).

Implements `core.sched.ports.GrammarManager`. Grammars compile in a thread pool while their
requests wait in WAITING_FOR_GRAMMAR; others keep running. Each step, the constrained requests
that sample get one bitmask row each (1 + drafts rows with speculative decoding); the matcher
advances on every accepted token.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import xgrammar as xgr

from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.structured.backend import XgrammarBackend

logger = logging.getLogger(__name__)


@dataclass
class RequestGrammar:
    future: concurrent.futures.Future
    matcher: xgr.GrammarMatcher | None = None
    error: str | None = None


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], XgrammarBackend], max_rollback_tokens: int = 0) -> None:
        self._make_backend = make_backend
        self._backend: XgrammarBackend | None = None
        self._max_rollback_tokens = max_rollback_tokens
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
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
                grammar.matcher = XgrammarBackend.new_matcher(compiled, self._max_rollback_tokens)
            except Exception as exc:  # noqa: BLE001 - any compile failure ends this request only
                grammar.error = str(exc)
                logger.warning("grammar for %s failed to compile: %s", request.request_id, exc)
                request.status = RequestStatus.FINISHED_ERROR
        return True

    def fill_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        rows: dict[str, int] = {}
        matchers = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            grammar = self._grammars.get(req_id)
            request = requests[req_id]
            # Only a chunk that reaches the end of the known tokens samples (this runs before
            # num_computed_tokens advances).
            if grammar is None or grammar.matcher is None or (
                    request.num_computed_tokens + num_new < request.num_tokens):
                continue
            rows[req_id] = len(matchers)
            matchers.append(grammar.matcher)
        if not matchers:
            return
        bitmask = torch.full((len(matchers), self._get_backend().bitmask_width), -1, dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        scheduler_output.structured_output_request_ids = rows
        scheduler_output.grammar_bitmask = bitmask.numpy()

    def accept_tokens(self, request: Request, token_ids: list[int]) -> None:
        grammar = self._grammars.get(request.request_id)
        if grammar is None or grammar.matcher is None:
            return
        for token_id in token_ids:
            if grammar.matcher.is_terminated():
                break
            if not grammar.matcher.accept_token(token_id):
                logger.warning("grammar rejected token %d of %s", token_id, request.request_id)
                if not request.is_finished:
                    request.status = RequestStatus.FINISHED_ERROR
                return

    def remove_request(self, request: Request) -> None:
        grammar = self._grammars.pop(request.request_id, None)
        if grammar is not None:
            grammar.future.cancel()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def pad_bitmask_rows(bitmask: np.ndarray | None, row_of: dict[str, int], req_ids: list[str],
                     width: int) -> torch.Tensor | None:
    """Grow the constrained rows to one row per sampled request; unconstrained rows allow all."""
    if bitmask is None:
        return None
    full = torch.full((len(req_ids), width), -1, dtype=torch.int32)
    for i, req_id in enumerate(req_ids):
        row = row_of.get(req_id)
        if row is not None:
            full[i] = torch.from_numpy(bitmask[row])
    return full
