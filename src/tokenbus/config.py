"""Frozen configuration (L0).

`EngineConfig` is the validated, resolved configuration the engine runs with, built from what a
user passes (`engine_args.EngineArgs`). Values found at run time (the model's shape, the
number of KV blocks) are added by building new objects, never by writing into these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30  # 2 GiB: ~45k tokens of SmolLM2-135M in fp32
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("auto", "gguf", "q8_0", "none")
# The resolved quantizations whose linears run on GGUF blocks (the native kernels, C layers).
BLOCK_QUANTIZATIONS = ("gguf", "q8_0")
QUANT_ACTIVATIONS = ("auto", "int16", "int8", "fp32", "bf16", "q8_k")
POOLERS = ("last", "mean")
SCHEDULING_POLICIES = ("fcfs", "priority")
# K/V element types: torch's, vLLM's fp8 names ("fp8" is fp8_e4m3; one scale per tensor) and
# llama.cpp's q8_0 (blocks of 32 int8 values and their fp16 scale: 34 bytes). model/kv_quant.py
# stores and converts them.
KV_CACHE_DTYPES = (
    "auto",
    "float32",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "q8_0",
)
QUANTIZED_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2", "q8_0")
Q8_0_BLOCK_VALUES, Q8_0_BLOCK_BYTES = 32, 34


def kv_row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes of one K (or V) row of a resolved kv_cache_dtype: one token's head_dim values of
    one KV head. q8_0 needs head_dim a multiple of its 32-value blocks."""
    if kv_cache_dtype == "q8_0":
        if head_dim % Q8_0_BLOCK_VALUES:
            raise ValueError(
                f"kv_cache_dtype q8_0 needs a head size that is a multiple of "
                f"{Q8_0_BLOCK_VALUES}, got {head_dim}"
            )
        return head_dim // Q8_0_BLOCK_VALUES * Q8_0_BLOCK_BYTES
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
    return head_dim * itemsize[kv_cache_dtype]


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None or "smollm2": the packaged SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # auto: float32 on CPU (benchmarks/cpu_speed.py --dtype), bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    max_logprobs: int = 20
    # auto: the native CPU kernel (model/native) on CPU in fp32/bf16 when it builds; Triton
    # (model/triton_attention.py) on CUDA; else torch
    attention_backend: str = "auto"
    # auto: the model's own files (safetensors for a directory, gguf for a GGUF); dummy: seeded
    # random weights for its config.json (vLLM's flag: real sizes whose weights are not at hand)
    load_format: str = "auto"
    # gguf: GGUF weights stay in their blocks (native kernels; their activations:
    # quant_activations); q8_0: as gguf, and every dense linear weight (a safetensors model's)
    # rounded to Q8_0 blocks at load, as llama.cpp's converter would; none: dequantized to
    # `dtype` at load; auto: gguf for a GGUF model on CPU, else none.
    quantization: str = "auto"
    # The activations of decode-sized calls on Q8_0/Q4_0/Q4_1 blocks kept quantized: rounded per
    # 32 values to int16 (integer dot products: greedy answers kept, logprobs close to fp32's)
    # or int8 (llama.cpp's approach: faster, but answers change; benchmarks/activation_error.py
    # measures both), or fp32 (weight-only: equal to the dequantized model up to rounding);
    # calls of more than 64 rows (long prefill chunks) then dequantize and multiply in fp32,
    # except without a bf16 engine (AVX2, AVX-512) under auto, int16 or int8 (integer tiles at
    # any size, ahead of the fp32 GEMM there). bf16 (CPUs with AVX512-BF16): x and W rounded to
    # bf16 for every call, summed in fp32 by AMX tiles or (no AMX) vdpbf16ps. q8_k (AVX-512
    # VNNI): x rounded to int8 per 256 values for every call (llama.cpp's Q8_K activations:
    # integer dot products at twice bf16's rate, coarser). auto: int16, and from 16 rows up bf16
    # on AMX (prefill chunks, decode batches of 16+); else q8_k on K-quant weights from 16 rows
    # on AVX-512 VNNI, bf16 from 32 with vdpbf16ps (prefill chunks), int8 on K-quant weights
    # from 16 rows on AVX2. layers/quantized.py's BF16_AUTO_MIN_ROWS, Q8_K_AUTO_MIN_ROWS,
    # INT8_K_QUANT_ISAS and GEMM_FROM_ROWS hold these thresholds.
    quant_activations: str = "auto"
    # Every token's logits independent of the rest of its step (batch mates, chunk size, prefix
    # cache hits, decode or prefill route), bit for bit: one activation mode at every size (auto:
    # int16, never bf16), GGUF and dense linears on kernels whose rows never depend on each
    # other, attention by the native kernel's decode path for every query
    # (model/batch_invariant.py). CPU, float32 only; slower prefill (docs/benchmarks.md).
    batch_invariant: bool = False
    # torch threads per rank on CPU; None: the cores this process may use (affinity, cgroup
    # quota) divided among the engine's ranks (tensor_parallel_size x data_parallel_size).
    num_threads: int | None = None
    pooler: str = "last"  # how /v1/embeddings pools the final hidden states: last | mean

    def __post_init__(self) -> None:
        if self.pooler not in POOLERS:
            raise ValueError(f"pooler must be one of {POOLERS}, got {self.pooler!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ValueError(
                f"quant_activations must be one of {QUANT_ACTIVATIONS}, "
                f"got {self.quant_activations!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be >= 0, or -1 for no limit, got {self.max_logprobs}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = (
        None  # bytes for K/V tensors; None: 2 GiB on CPU, profiled on CUDA
    )
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = (
        None  # exact pool size (tests, forcing preemption); wins over memory
    )
    # K/V element type. auto: float16 for an fp32 model on GGUF blocks on CPU (a batched decode
    # step reads mostly K/V: half the bytes, rounding ~5e-4), else the model's dtype. fp8_e4m3,
    # fp8_e5m2 ("fp8": e4m3) and q8_0 (CPU): 1 and 1.06 bytes a value, about 2x fp16's tokens.
    kv_cache_dtype: str = "auto"
    # vLLM's flag: a model with sliding-window layers holds every layer's blocks for the whole
    # context (windows still masked) instead of one KV group per window (core/kv/hybrid.py)
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no cap; applies only when >1 request competes
    max_model_len: int = 8192  # resolved against the model before the engine starts
    max_waiting_requests: int | None = None  # front-end admission bound (server answers 503)
    # fcfs: arrival order, the last admitted preempted first; priority: (priority, arrival)
    # order, a lower value first, and the lowest priority (latest among equals) preempted first.
    scheduling_policy: str = "fcfs"
    # Schedule the next step before reading the last one's tokens (engine/core.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (--enable-lora): each a low-rank side path on the linears
    (model/lora.py), chosen per request."""

    max_loras: int = 1  # distinct adapters in one batch (each has a slot in every linear)
    max_lora_rank: int = 16  # the largest rank an adapter may have (slots are this wide)
    max_cpu_loras: int | None = None  # adapters a worker keeps loaded; None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cached_adapters(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class StructuredOutputsConfig:
    # The front-door check of a spec (structured/validator.py): seconds its compile may take,
    # each check in a process that is killed at the deadline, and how many run at once.
    grammar_compile_timeout: float = 10.0
    max_concurrent_grammar_compiles: int = 4

    def __post_init__(self) -> None:
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}"
            )
        if self.max_concurrent_grammar_compiles < 1:
            raise ValueError(
                "max_concurrent_grammar_compiles must be >= 1, "
                f"got {self.max_concurrent_grammar_compiles}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" or "draft_model"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # draft model path or name
    draft_layers: int | None = None  # self-speculation: the target's first N layers

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and self.model is None and self.draft_layers is None:
            raise ValueError("speculative_config: draft_model needs 'model' or 'draft_layers'")

    @classmethod
    def from_dict(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        import json

        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        return cls(**value)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (kv_transfer/): which one, and whether this instance produces KV (saves or
    serves it), consumes it (loads it instead of computing) or both."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    # A block that fails to load: recompute its tokens, or fail the request.
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None  # names this instance to its peers; None: one is made up

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_transfer_config.kv_connector must name a connector")
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy must be one of "
                f"{KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
        if self.engine_id is None:  # resolved once, here: every half and rank sees the same
            import uuid

            object.__setattr__(self, "engine_id", f"tokenbus-{uuid.uuid4().hex[:12]}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        import json

        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config: not valid JSON ({exc})") from exc
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config: 'kv_connector' is required")
        return cls(**value)


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8, up to max_num_seqs (included), none above the token budget."""
    largest = min(max_num_seqs, max_num_batched_tokens)
    sizes = sorted({s for s in (1, 2, 4, 8, *range(16, largest + 1, 8), largest) if s <= largest})
    return tuple(sizes)


@dataclass(frozen=True)
class CompilationConfig:
    """Captured decode steps (docs/architecture.md): decode batches (and speculative
    verification batches) padded to a capture size replay a CUDA graph; others run eagerly
    (as every CPU step does)."""

    enforce_eager: bool = (
        False  # never capture: every step runs op by op (on CPU: no C decode layers either)
    )
    # Batch sizes (requests a step) to capture, strictly increasing; resolved from
    # max_num_seqs when not given (default_capture_sizes). Empty with enforce_eager.
    cudagraph_capture_sizes: tuple[int, ...] = ()
    # The user listed the sizes: a capture that fails at start-up is then an error, not a
    # warning and eager steps.
    capture_sizes_explicit: bool = False

    @property
    def max_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    @classmethod
    def resolve(
        cls,
        enforce_eager: bool,
        sizes: list[int] | tuple[int, ...] | str | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> CompilationConfig:
        """Check --enforce-eager / --cudagraph-capture-sizes against the scheduler's limits."""
        flag = "cudagraph_capture_sizes (--cudagraph-capture-sizes)"
        if sizes is not None and enforce_eager:
            raise ValueError(
                f"{flag} cannot be combined with enforce_eager (--enforce-eager): "
                "eager mode captures nothing"
            )
        if enforce_eager:
            return cls(enforce_eager=True)
        if sizes is None:
            return cls(
                cudagraph_capture_sizes=default_capture_sizes(max_num_seqs, max_num_batched_tokens)
            )
        parsed = _parse_sizes(sizes, flag)
        if not parsed:
            raise ValueError(f"{flag} must list at least one size (or use --enforce-eager)")
        if min(parsed) < 1:
            raise ValueError(f"{flag}: sizes must be >= 1, got {min(parsed)}")
        if any(b <= a for a, b in zip(parsed, parsed[1:])):
            raise ValueError(f"{flag} must be strictly increasing, got {list(parsed)}")
        if parsed[-1] > max_num_batched_tokens:
            raise ValueError(
                f"{flag}: size {parsed[-1]} is above max_num_batched_tokens "
                f"(--max-num-batched-tokens) = {max_num_batched_tokens}"
            )
        return cls(cudagraph_capture_sizes=parsed, capture_sizes_explicit=True)


def _parse_sizes(sizes: list[int] | tuple[int, ...] | str, flag: str) -> tuple[int, ...]:
    items = sizes.replace(",", " ").split() if isinstance(sizes, str) else list(sizes)
    try:
        if any(isinstance(item, bool) or float(item) != int(item) for item in items):
            raise ValueError
        return tuple(int(item) for item in items)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be integers, got {sizes!r}") from None


EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DATA_PARALLEL_ROUTINGS = ("prefix", "least_loaded", "round_robin")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks that split each layer's heads and MLP columns
    data_parallel_size: int = 1  # independent EngineCores behind a load balancer
    # How the ranks of one engine run: "uni" (one worker in the EngineCore's process), "mp"
    # (a process per rank) or "ray" (Ray actors). None: "uni" for one rank, else "mp".
    distributed_executor_backend: str | None = None
    # Which of the data-parallel engines this is (set per engine by the front end; it picks
    # the engine's GPUs: data_parallel_rank * tensor_parallel_size + rank).
    data_parallel_rank: int = 0
    # Which data-parallel engine gets a new request: "prefix" (the one likely to hold its
    # prompt's prefix, unless far busier), "least_loaded" or "round_robin" (engine/dp_router.py).
    data_parallel_routing: str = "prefix"
    # The Ray cluster to attach to ("host:port", "auto"); None: $RAY_ADDRESS, else a local one.
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ValueError(
                f"data_parallel_routing must be one of {DATA_PARALLEL_ROUTINGS}, "
                f"got {self.data_parallel_routing!r}"
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}"
            )
        if backend is None:  # resolved once, here: frozen afterwards
            object.__setattr__(
                self,
                "distributed_executor_backend",
                "uni" if self.tensor_parallel_size == 1 else "mp",
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size="
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )

    @property
    def world_size(self) -> int:
        """Ranks of one engine (data-parallel engines each have their own)."""
        return self.tensor_parallel_size


# The settings whose `auto` engine/setup.resolve_config turns into a fact before any worker
# starts. quant_activations keeps its auto: that one picks per call size, not once.
RESOLVED_SETTINGS = (
    ("model", "device"),
    ("model", "dtype"),
    ("model", "quantization"),
    ("model", "attention_backend"),
    ("model", "load_format"),
    ("cache", "kv_cache_dtype"),
)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig | None = None  # None: no adapters (--enable-lora off)

    def unresolved_settings(self) -> list[str]:
        """The RESOLVED_SETTINGS still `auto`, as "model.device" & co (none once resolved)."""
        return [
            f"{part}.{name}"
            for part, name in RESOLVED_SETTINGS
            if getattr(getattr(self, part), name) == "auto"
        ]
