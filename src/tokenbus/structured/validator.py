"""Front-door check of structured-output specs: compile with a deadline (L2).

A spec that does not compile is a ValueError (HTTP 400) before the request reaches the engine;
one whose compilation runs past the deadline (a pathological regex) is refused the same way.
"""

from __future__ import annotations

import concurrent.futures

from tokenbus.sampling_params import StructuredOutputsParams
from tokenbus.structured.backend import XgrammarBackend

DEFAULT_COMPILE_TIMEOUT_S = 10.0


class StructuredOutputValidator:
    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._backend: XgrammarBackend | None = None  # built on first use: ~1 s of tokenizer work
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")

    def validate(self, spec: StructuredOutputsParams) -> None:
        if self._backend is None:
            self._backend = XgrammarBackend(self._tokenizer, self._vocab_size)
        future = self._pool.submit(self._backend.compile, spec)
        try:
            future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            # The compile thread cannot be killed; it finishes in the background, the engine
            # never sees this request.
            raise ValueError(f"structured_outputs: grammar compilation took longer than "
                             f"{self._timeout_s:g} s; simplify the schema/regex") from None
