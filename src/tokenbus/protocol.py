"""Types that cross the front end ↔ EngineCore boundary (L0). msgspec Structs, never pickle."""

from __future__ import annotations

import enum

import msgspec

from tokenbus.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:  # the OpenAI spelling
        return self.name.lower()


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter to run a request with: a PEFT directory (adapter_config.json and
    adapter_model.safetensors) under a name. Name and path together identify it (its KV is
    cached under both), so an adapter reloaded from elsewhere under the same name shares no
    cached blocks with the old one."""

    lora_name: str
    lora_path: str


class EngineRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    cache_salt: str | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one sampled position: the sampled token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the full distribution


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # Prompt logprobs of this step's prefill chunk: one per prompt token after the first that
    # the chunk's positions predict (the prompt token first, then the top-n).
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0  # the prompt position of new_prompt_logprobs[0]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended the request
    pooled: list[float] | None = None  # an embedding request's vector (SamplingParams.pooling)
    num_cached_tokens: int = 0
    # Wall-clock time (time.time(), the clock of EngineRequest.arrival_time) at which the engine
    # first scheduled the request; set on the request's first output only (queue-time metric).
    first_scheduled_time: float = 0.0
    # A finished request's KV connector params (a prefiller's: where a decoder finds its KV).
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, null block excluded
    prefix_cache_queries: int = 0  # tokens looked up (this step)
    prefix_cache_hits: int = 0  # tokens found (this step)
    num_preemptions: int = 0  # this step
    num_prompt_tokens: int = 0  # computed this step (prefill work)
    num_generation_tokens: int = 0  # sampled this step
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # KV connector (kv_transfer/): prefix tokens looked up / found outside the pool this step,
    # and K/V moved.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    kv_load_seconds: float = 0.0
    kv_save_seconds: float = 0.0
    kv_tier_bytes: dict[str, int] = {}  # bytes held per tier of the connector's store (gauges)


class BlockState(enum.IntEnum):
    """A KV block as /xray draws it (one byte per block in XraySnapshot.block_states)."""

    NULL = 0  # block 0: the padding target, never handed out
    FREE = 1  # in the free queue, holding no cached prefix
    CACHED = 2  # in the free queue with its prefix hash: a hit until it is evicted
    USED = 3  # held by one request
    SHARED = 4  # held by several requests (a shared prefix)


class XrayRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as the scheduler holds it at a snapshot."""

    request_id: str
    status: str  # running | waiting | preempted | waiting_for_grammar | loading_kv
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int  # tokens whose KV is in (or being written to) its blocks
    num_cached_tokens: int  # its prefix-cache hit when first scheduled (0 before)
    num_preemptions: int
    block_ids: list[int]  # its block table, the first ones only (xray.MAX_ROW_BLOCK_IDS)
    num_blocks: int = 0  # the whole table's length
    priority: int = 0
    num_draft_tokens: int = 0  # spec decode: drafts verified so far
    num_accepted_tokens: int = 0  # ... and accepted


class XrayStep(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine step did."""

    index: int
    timestamp: float  # time.time() when the step ended
    duration_ms: float
    num_reqs: int  # requests in the batch
    num_prefill_tokens: int  # prompt tokens, chunks and recomputation after preemption
    num_decode_tokens: int  # tokens of requests that were generating (drafts included)
    num_preemptions: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class XraySnapshot(msgspec.Struct, omit_defaults=True):
    """The scheduler and block pool of one engine at one moment, and its last steps (/xray)."""

    timestamp: float  # time.time()
    step_index: int  # steps taken so far
    block_size: int
    num_blocks: int
    block_states: bytes  # one BlockState per block, by block id
    ref_counts: bytes  # min(ref_cnt, 255) per block, by block id
    num_free_blocks: int
    free_order: list[int]  # free block ids in eviction order (head first), the first ones only
    num_requests: int  # requests in the scheduler; `requests` lists the first ones
    requests: list[XrayRequest] = []
    steps: list[XrayStep] = []  # the last steps, oldest first
    kv_loading: list[str] = []  # requests whose KV a connector is loading (P/D, disk tier)
    kv_sending: list[str] = []  # finished requests whose KV a connector still sends
    engine_index: int = 0  # set by the front end, as for EngineOutputs


class EngineOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # A snapshot for /xray, at most a few a second and only while a viewer watches.
    xray: XraySnapshot | None = None
    # Which data-parallel engine sent them: set on the front end's side as they arrive.
    engine_index: int = 0
