"""Per-step sampling tensors (L3).

The worker describes each row of the batch with a `SamplingRow`; `SamplingMetadata.build` turns
the rows into batched tensors once per step. Every optional part stays None when no row uses
it, so a batch of plain greedy or plain temperature rows takes the sampler's fast path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbus.sampling_params import PENALTIES_OFF, SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per-request generator created by the worker from `params.seed` (None: unseeded). It must
    # live on the logits' device.
    generator: torch.Generator | None = None
    # EOS + stop_token_ids, masked while the request has fewer outputs than params.min_tokens.
    stop_ids_for_min_tokens: list[int] = field(default_factory=list)
    # Outputs sampled by the last step and not read back yet, beyond output_token_ids (async
    # scheduling: 0 or 1). Their ids are on the device (SamplingMetadata.build's `unread`).
    num_unread_outputs: int = 0


@dataclass
class SamplingMetadata:
    """Batched sampling settings for one step; B = rows, V = vocab_size."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # Bool[B]; only when greedy and random rows are mixed
    temperature: torch.Tensor | None  # Float[B]; None when no random row has temperature != 1
    top_k: torch.Tensor | None  # Long[B]; rows without top-k hold vocab_size
    max_top_k: int  # the largest k of the rows with top-k (a host int: no read of top_k); 0
    top_p: torch.Tensor | None  # Float[B]; rows without top-p hold 1.0
    min_p: torch.Tensor | None  # Float[B]; rows without min-p hold 0.0
    generators: dict[int, torch.Generator]  # row → generator, seeded random rows only
    repetition_penalty: torch.Tensor | None  # Float[B]; 1.0 = off
    presence_penalty: torch.Tensor | None  # Float[B]; 0.0 = off
    frequency_penalty: torch.Tensor | None  # Float[B]; 0.0 = off
    # Penalties read (row, token id) pairs, not [B, V] tables: only rows with a penalty have
    # pairs, one per occurrence (repeats included).
    prompt_token_indices: torch.Tensor | None  # Long[2, P]: prompt tokens (repetition only)
    output_token_indices: torch.Tensor | None  # Long[2, M]: output tokens, unread ones last
    output_token_counts: torch.Tensor | None  # Float[M]: each pair's occurrences (frequency)
    logit_bias_indices: torch.Tensor | None  # Long[2, N]: (row, token id) pairs
    logit_bias_values: torch.Tensor | None  # Float[N]: added to the logits at those pairs
    min_tokens_indices: torch.Tensor | None  # Long[2, M]: (row, token id) pairs set to -inf
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # Structured output: Int32[B, ceil(V / 32)], bit i of word j allows token 32 * j + i; a row
    # of all ones is unconstrained. Set by the worker after build (xgrammar fills it).
    grammar_bitmask: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return self.output_token_indices is not None

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        unread: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """`unread`: the rows whose last output is not read back yet
        (SamplingRow.num_unread_outputs) and those outputs, Long[M] on the device, where the
        penalties count them."""
        params = [row.params for row in rows]
        is_greedy = [p.is_greedy for p in params]
        random_params = [p for p in params if not p.is_greedy]
        all_greedy = not random_params
        all_random = not any(is_greedy)
        top_k = _top_k_values(params, vocab_size)
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else _tensor(is_greedy, torch.bool, device),
            temperature=_temperature(params, device),
            top_k=None if top_k is None else _tensor(top_k, torch.long, device),
            max_top_k=max((k for k in top_k or () if k < vocab_size), default=0),
            top_p=_per_row(params, lambda p: p.top_p, off=1.0, device=device),
            min_p=_per_row(params, lambda p: p.min_p, off=0.0, device=device),
            generators={
                i: row.generator
                for i, row in enumerate(rows)
                if row.generator is not None and not row.params.is_greedy
            },
            **_penalties(rows, vocab_size, device, unread),
            **_logit_bias(rows, vocab_size, device),
            min_tokens_indices=_min_tokens_indices(rows, vocab_size, device),
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
        )


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A step's host tensor on the device. On CUDA through pinned memory, without waiting: the
    copy queues on the stream behind the step's forward, and the host goes on."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _temperature(params: list[SamplingParams], device: torch.device | str) -> torch.Tensor | None:
    # Greedy rows hold 1.0: they take the argmax before temperature is applied.
    values = [1.0 if p.is_greedy else p.temperature for p in params]
    if all(v == 1.0 for v in values):
        return None
    return _tensor(values, torch.float32, device)


def _top_k_values(params: list[SamplingParams], vocab_size: int) -> list[int] | None:
    # top_k of 0 or -1 (or >= V) disables it.
    values = [
        vocab_size if p.is_greedy or p.top_k <= 0 else min(p.top_k, vocab_size) for p in params
    ]
    if all(v == vocab_size for v in values):
        return None
    return values


def _per_row(
    params: list[SamplingParams],
    get: Callable[[SamplingParams], float],
    off: float,
    device: torch.device | str,
) -> torch.Tensor | None:
    """A Float[B] of a random-sampling setting, or None when every row has it at `off`."""
    values = [off if p.is_greedy else float(get(p)) for p in params]
    if all(v == off for v in values):
        return None
    return _tensor(values, torch.float32, device)


def _penalties(
    rows: list[SamplingRow],
    vocab_size: int,
    device: torch.device | str,
    unread: tuple[list[int], torch.Tensor] | None,
) -> dict:
    # Each penalty some row uses, Float[B]; None for the others.
    used = {
        name: _tensor([getattr(row.params, name) for row in rows], torch.float32, device)
        if any(getattr(row.params, name) != off for row in rows)
        else None
        for name, off in PENALTIES_OFF.items()
    }
    if all(penalty is None for penalty in used.values()):
        return dict(
            used, prompt_token_indices=None, output_token_indices=None, output_token_counts=None
        )
    # Rows without a penalty hold its off value: applied to their pairs it would change nothing,
    # so they get none.
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    outputs = _token_indices([rows[i].output_token_ids for i in penalized], penalized, device)
    if unread is not None:
        unread_rows, unread_tokens = unread
        kept = [j for j, row in enumerate(unread_rows) if rows[row].params.has_penalties]
        if kept:
            kept_rows = _tensor([unread_rows[j] for j in kept], torch.long, device)
            kept_tokens = unread_tokens[_tensor(kept, torch.long, device)]
            outputs = torch.cat([outputs, torch.stack([kept_rows, kept_tokens])], dim=1)
    prompts = counts = None
    if used["repetition_penalty"] is not None:
        prompts = _token_indices([rows[i].prompt_token_ids for i in penalized], penalized, device)
    if used["frequency_penalty"] is not None:
        counts = _pair_counts(outputs, vocab_size)
    return dict(
        used,
        prompt_token_indices=prompts,
        output_token_indices=outputs,
        output_token_counts=counts,
    )


def _token_indices(
    token_lists: list[list[int]], row_ids: list[int], device: torch.device | str
) -> torch.Tensor:
    """Long[2, N]: (row, token id) for every id of every list, list i's ids in row row_ids[i]."""
    # Every listed id, each step: flattened in C by numpy, not by a Python comprehension over
    # every id; each id's row made on the host, where repeat_interleave of device lengths would
    # read them back.
    lengths = [len(ids) for ids in token_lists]
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, sum(lengths))
    rows = np.repeat(np.asarray(row_ids, dtype=np.int64), lengths)
    return to_device(torch.from_numpy(np.stack([rows, flat])), device)


def _pair_counts(pairs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Float[N]: how often each (row, token id) pair of Long[2, N] occurs among them, counted on
    the device without reading anything back: its number of equal keys in the sorted keys."""
    keys = pairs[0] * vocab_size + pairs[1]
    ordered = keys.sort().values
    counts = torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)
    return counts.float()


def _logit_bias(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> dict:
    pairs = [
        (i, int(token_id), float(bias))
        for i, row in enumerate(rows)
        for token_id, bias in (row.params.logit_bias or {}).items()
    ]
    if not pairs:
        return dict(logit_bias_indices=None, logit_bias_values=None)
    bad = [token_id for _, token_id, _ in pairs if not 0 <= token_id < vocab_size]
    if bad:  # the front door validates; this guards against a crash deep in a kernel
        raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})")
    row_ids, token_ids, values = zip(*pairs)
    return dict(
        logit_bias_indices=_tensor([row_ids, token_ids], torch.long, device),
        logit_bias_values=_tensor(list(values), torch.float32, device),
    )


def _min_tokens_indices(
    rows: list[SamplingRow], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    # Ids outside the vocabulary can never be sampled, so they need no mask.
    pairs = [
        (i, token_id)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) + row.num_unread_outputs < row.params.min_tokens
        for token_id in set(row.stop_ids_for_min_tokens)
        if 0 <= token_id < vocab_size
    ]
    if not pairs:
        return None
    return _tensor(list(zip(*pairs)), torch.long, device)  # [2, M]
