"""Engine outputs (token ids) → RequestOutputs (text), in the front-end process (L4).

Detokenizes incrementally, finds stop strings (the engine must then abort the request), joins
the n children of a parallel-sampling request, and keeps per-request timing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenbus.engine.detokenizer import IncrementalDetokenizer
from tokenbus.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenbus.protocol import EngineOutput, FinishReason, TokenLogprobs
from tokenbus.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    FINAL_ONLY = 0  # one RequestOutput when every child has finished (offline generate)
    DELTA = 1  # a RequestOutput per step with the new text of one child (streaming)


@dataclass
class ParentRequest:
    """A user request; its n children run as separate engine requests sharing the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    kind: OutputKind
    metrics: RequestMetrics
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    # With prompt_logprobs: one entry per prompt token (the first None), filled chunk by chunk
    # from the first child's outputs; handed out with the request's first output (DELTA).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    pooled: list[float] | None = None  # an embedding request's vector, from its last output
    kv_transfer_params: dict | None = None  # the KV connector's, from its last output

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.n and all(
            c.finished() for c in self.completions.values()
        )


@dataclass
class ChildState:
    request_id: str
    index: int
    parent: ParentRequest
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # stopped by a stop string: the engine must drop them


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, ChildState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary

    def add_request(
        self, parent: ParentRequest, child_id: str, index: int, params: SamplingParams
    ) -> None:
        self.parents[parent.request_id] = parent
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        detok = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, params)
        self.children[child_id] = ChildState(
            child_id,
            index,
            parent,
            params,
            detok,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.children)

    def abort_requests(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            child = self.children.pop(child_id, None)
            if child is not None and not any(
                c.parent is child.parent for c in self.children.values()
            ):
                self.parents.pop(child.parent.request_id, None)

    def process_outputs(self, outputs: list[EngineOutput], timestamp: float) -> ProcessedOutputs:
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for out in outputs:
            child = self.children.get(out.request_id)
            if child is None:
                continue  # aborted by the front end while the engine was stepping
            finish_reason, stop_reason = self._update_child(child, out, timestamp)
            if not out.new_token_ids and finish_reason is None:
                continue  # a prefill chunk's prompt logprobs: kept for the first real output
            if finish_reason is not None and out.finish_reason is None:
                reqs_to_abort.append(child.request_id)  # a stop string the engine cannot see
            request_output = self._make_output(child, finish_reason, stop_reason, timestamp)
            if finish_reason is not None:
                self._finish_child(child)
            if request_output is not None:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _update_child(self, child: ChildState, out: EngineOutput, now: float):
        metrics = child.parent.metrics
        if out.new_token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.num_generation_tokens += len(out.new_token_ids)
        child.parent.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            child.parent.pooled = out.pooled
        if out.kv_transfer_params is not None:
            child.parent.kv_transfer_params = out.kv_transfer_params
        prompt_logprobs = child.parent.prompt_logprobs
        if out.new_prompt_logprobs and prompt_logprobs is not None:
            # Entries cover positions start, start + 1, ...; a preempted request recomputes its
            # prompt from the start: what is known already is not added again.
            skip = len(prompt_logprobs) - out.prompt_logprobs_start
            if skip >= 0:
                prompt_logprobs.extend(
                    self._convert_logprobs(e) for e in out.new_prompt_logprobs[skip:]
                )
        child.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and child.logprobs is not None:
            for entry in out.new_logprobs:
                child.logprobs.append(self._convert_logprobs(entry))
                child.cumulative_logprob += entry.logprobs[0]
        by_token = out.finish_reason == FinishReason.STOP  # EOS or a stop token id, engine-side
        stop_string = child.detokenizer.update(out.new_token_ids, stop_terminated=by_token)
        if stop_string is not None:
            return str(FinishReason.STOP), stop_string
        if out.finish_reason is not None:
            return str(out.finish_reason), out.stop_reason
        return None, None

    def _convert_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        ranks = [entry.sampled_rank] + list(range(1, len(entry.token_ids)))
        result: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        return result

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, decoded once per token id (prompt logprobs ask for a lot)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _make_output(
        self, child: ChildState, finish_reason, stop_reason, now
    ) -> RequestOutput | None:
        parent = child.parent
        finished = finish_reason is not None
        if parent.kind is OutputKind.DELTA:
            completion = CompletionOutput(
                index=child.index,
                text=child.detokenizer.get_delta(finished),
                token_ids=child.token_ids[child.num_sent_tokens :],
                cumulative_logprob=child.cumulative_logprob,
                logprobs=child.logprobs[child.num_sent_tokens :]
                if child.logprobs is not None
                else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            child.num_sent_tokens = len(child.token_ids)
            parent.completions[child.index] = completion
            if finished and parent.finished:
                parent.metrics.finished_time = now
            return self._request_output(parent, [completion], parent.finished)
        if not finished:
            return None
        parent.completions[child.index] = CompletionOutput(
            index=child.index,
            text=child.detokenizer.output_text,
            token_ids=list(child.token_ids),
            cumulative_logprob=child.cumulative_logprob,
            logprobs=child.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        if not parent.finished:
            return None
        parent.metrics.finished_time = now
        return self._request_output(parent, [parent.completions[i] for i in range(parent.n)], True)

    @staticmethod
    def _request_output(
        parent: ParentRequest, completions: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        prompt_logprobs = None
        # Only once complete: with n > 1 another child's first token may come before the prompt
        # logprobs of the child computing them are all in.
        if (
            parent.prompt_logprobs is not None
            and not parent.prompt_logprobs_sent
            and len(parent.prompt_logprobs) == len(parent.prompt_token_ids)
        ):
            prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            pooled=parent.pooled,
            kv_transfer_params=parent.kv_transfer_params if finished else None,
        )

    def _finish_child(self, child: ChildState) -> None:
        del self.children[child.request_id]
        if child.parent.finished:
            self.parents.pop(child.parent.request_id, None)
