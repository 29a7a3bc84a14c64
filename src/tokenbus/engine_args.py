"""What a user may set for an engine (L0): `EngineArgs`, one field per CLI flag.

`EngineArgs.to_config` validates them into the frozen `config.EngineConfig` the engine runs
with; cli/args.py makes each field a flag. vLLM keeps the same split (arg_utils / config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenbus.config import (
    ATTENTION_BACKENDS,
    DATA_PARALLEL_ROUTINGS,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POOLERS,
    QUANT_ACTIVATIONS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from tokenbus.utils import parse_size


def _arg(
    default=None,
    help: str | None = None,
    *,
    choices: tuple | None = None,
    flag: bool = True,
    hidden: bool = False,
    default_factory=None,
    nargs: str | None = None,
):
    """An EngineArgs field; `help`/`choices` feed its CLI flag (cli/args.py); flag=False has no
    flag, hidden=True one that --help does not list; nargs="+" one that takes a list of ints."""
    metadata = {"help": help, "choices": choices, "flag": flag, "hidden": hidden, "nargs": nargs}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    """Everything a user may set, named like the CLI flags (`--max-num-seqs` → max_num_seqs).

    The one list of engine options: each field becomes a flag (cli/args.py) and lands in the
    sub-config with a field of the same name (to_config); nothing else repeats them."""

    model: str | None = _arg(flag=False)  # the CLI's positional argument
    tokenizer: str | None = _arg()
    dtype: str = _arg("auto", "auto: float32 on CPU, bfloat16 on CUDA", choices=DTYPES)
    device: str = _arg("auto", "auto: cuda when available, else cpu")
    max_model_len: int | None = _arg()
    seed: int = _arg(0)
    max_logprobs: int = _arg(
        20, "the most logprobs a request may ask for per position; -1: no limit"
    )
    enforce_eager: bool = _arg(
        False,
        "never capture decode steps: every step runs op by op (no CUDA graphs on "
        "CUDA; on CPU no decoder layer per C call)",
    )
    cudagraph_capture_sizes: list[int] | str | None = _arg(
        None,
        "decode batch sizes (requests) to capture as CUDA graphs, strictly increasing "
        "(default: 1 2 4 8, then steps of 8 up to --max-num-seqs), speculative verification "
        "steps at the same sizes; larger batches and prefill chunks run eagerly",
        nargs="+",
    )
    attention_backend: str = _arg(
        "auto",
        "auto: a native C kernel on CPU (float32/bfloat16) when it builds, Triton on CUDA, "
        "else torch",
        choices=ATTENTION_BACKENDS,
    )
    load_format: str = _arg(
        "auto",
        "auto: the model's own files (safetensors or gguf); dummy: seeded random weights for "
        "the model's config.json (real sizes without their weights; on the target device and "
        "dtype)",
        choices=LOAD_FORMATS,
    )
    quantization: str = _arg(
        "auto",
        "gguf: GGUF weights stay quantized (native kernels); q8_0: as gguf, and "
        "dense linear weights (safetensors) rounded to Q8_0 blocks at load (CPU); none: "
        "dequantize to --dtype; auto: gguf for GGUF models on CPU, q8_0 for FP8, GPTQ, "
        "AWQ, compressed-tensors and bitsandbytes safetensors on CPU (4-bit integers in "
        "groups of 32k kept as Q4_1 blocks)",
        choices=QUANTIZATIONS,
    )
    quant_activations: str = _arg(
        "auto",
        "activations of decode steps on Q8_0/Q4_0/Q4_1 blocks, rounded "
        "per 32 values: int16 (logprobs within ~3e-4 of fp32's), int8 "
        "(llama.cpp's approach: faster, coarser), or fp32 (weight-only); "
        "bf16: every call in bf16 (CPUs with AVX512-BF16: AMX tiles or "
        "vdpbf16ps); q8_k: every call in int8 per 256 values (llama.cpp's "
        "Q8_K; AVX-512 VNNI); auto: int16, and bf16 for calls of 16+ rows on "
        "AMX (prefill, batches), else q8_k on K-quants for 16+ (VNNI) and bf16 "
        "for 32+ (prefill), else int8 on K-quants for 16+ (AVX2); on AVX2 or "
        "AVX-512 without a bf16 engine, auto's int16 and an explicit "
        "int8/int16 cover prefill chunks too",
        choices=QUANT_ACTIVATIONS,
    )
    batch_invariant: bool = _arg(
        False,
        "make each request's output independent of its batch mates, chunk size and prefix-cache "
        "hits, bit for bit (vLLM's VLLM_BATCH_INVARIANT): int16 activations at every size, "
        "row-independent linears, every attention query by the decode kernel. CPU, float32. "
        "Costs prefill speed, not decode: 1.47x slower prefill on an AVX512-BF16 CPU, 1.1x on "
        "AVX2 (docs/cpu.md, docs/benchmarks.md)",
    )
    num_threads: int | None = _arg(
        None,
        "torch threads per rank on CPU; default: the usable cores (affinity, cgroup quota) / ranks",
    )
    pooler: str = _arg(
        "last",
        "how /v1/embeddings pools the final hidden states (then L2-normalised)",
        choices=POOLERS,
    )
    block_size: int = _arg(16)
    kv_cache_memory: int | str | None = _arg(None, "bytes or a size like 2GiB")
    gpu_memory_utilization: float = _arg(0.9)
    enable_prefix_caching: bool = _arg(True)
    num_kv_blocks: int | None = _arg(None, "an exact KV pool size (tests)", hidden=True)
    disable_hybrid_kv_cache_manager: bool = _arg(
        False,
        "hold every layer's KV blocks for the whole context, sliding-window layers too, "
        "instead of freeing those that fell out of the window (one KV group per window)",
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "K/V element type; auto: float16 for float32 models on GGUF blocks "
        "on CPU (half the bytes a decode step reads), else --dtype. On CPU, fp8_e4m3 (fp8), "
        "fp8_e5m2 and q8_0 store 1 or 1.06 bytes a value: about 2x fp16's tokens in the same "
        "--kv-cache-memory, for slightly rounder attention (q8_0 closest, e5m2 roughest)",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = _arg(128)
    max_num_batched_tokens: int = _arg(2048)
    long_prefill_token_threshold: int = _arg(0)
    scheduling_policy: str = _arg(
        "fcfs",
        "fcfs: first come, first served; priority: by each request's priority (lower first, "
        "then arrival), the lowest priority preempted first under memory pressure",
        choices=SCHEDULING_POLICIES,
    )
    async_scheduling: bool = _arg(
        False,
        "schedule and prepare the next step while the device runs this one (its decodes "
        "take their input token from the sampled ids on the device): the host's part of a "
        "step no longer idles a GPU. Steps run one at a time while a request uses structured "
        "output; not with speculative decoding or a KV connector",
    )
    grammar_compile_timeout: float = _arg(
        10.0,
        "seconds a structured-output spec may take to compile at the front door; past it the "
        "compile is killed and the spec refused (400), and refused again at once for 10 min",
    )
    max_concurrent_grammar_compiles: int = _arg(
        4, "structured-output specs compiled at once (one process, one core each)"
    )
    # The server's admission bound; `serve` has its own flag for it (the server answers 503).
    max_waiting_requests: int | None = _arg(flag=False)
    generation_config: str = _arg(
        "auto",
        "sampling defaults for requests that leave them out: auto (the model's "
        "generation_config.json; the packaged SmolLM2: its model card's temperature 0.2, "
        "top_p 0.9), vllm (none: temperature 1, top_p 1, as vLLM's), or a directory or "
        "file holding a generation_config.json",
    )
    override_generation_config: dict | str | None = _arg(
        None, "JSON overriding single sampling defaults, e.g. '{\"temperature\": 0.5}'"
    )
    speculative_config: dict | str | SpeculativeConfig | None = _arg(
        None, 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''
    )
    kv_transfer_config: dict | str | KVTransferConfig | None = _arg(
        None,
        'JSON naming a KV connector, e.g. \'{"kv_connector": "SharedStorageConnector", '
        '"kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}\'',
    )
    tensor_parallel_size: int = _arg(1, "ranks that split each layer (torch.distributed)")
    data_parallel_size: int = _arg(1, "EngineCore processes behind one load-balancing client")
    data_parallel_routing: str = _arg(
        "prefix",
        "which data-parallel engine gets a request: prefix (the one that was sent the "
        "longest part of its prompt, unless it is far busier), least_loaded, round_robin",
        choices=DATA_PARALLEL_ROUTINGS,
    )
    distributed_executor_backend: str | None = _arg(
        None,
        "how ranks run: uni (in the engine process), mp (a process each), ray; default: uni "
        "for one rank, else mp",
        choices=EXECUTOR_BACKENDS,
    )
    ray_address: str | None = _arg(
        None,
        "the Ray cluster for --distributed-executor-backend ray "
        "(host:port); default: $RAY_ADDRESS, else a local cluster",
    )
    enable_lora: bool = _arg(
        False,
        "serve LoRA adapters (PEFT format): requests name one (the server's --lora-modules, "
        "or LLM.generate(lora_request=...)); each runs as a low-rank side path of the linears",
    )
    max_loras: int = _arg(1, "distinct LoRA adapters in one batch")
    max_lora_rank: int = _arg(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _arg(
        None, "LoRA adapters kept loaded in memory (default: --max-loras)"
    )
    # The EngineCore in its own process (ZMQ + msgspec) for the offline LLM; False runs it in
    # the caller's process (tests, debugging). The server chooses with --engine-in-process.
    multiprocess: bool = _arg(True, flag=False)
    engine_ready_timeout_s: float = _arg(600.0, flag=False)  # start-up (model load) limit

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(**kwargs)

    def to_config(self, max_model_len: int) -> EngineConfig:
        """Build the frozen config once the model's context length is known: each sub-config
        takes the fields named like its own, with these resolved values in their place."""
        resolved = dict(
            max_model_len=max_model_len,
            kv_cache_memory=parse_size(self.kv_cache_memory),
            data_parallel_rank=0,
        )  # each data-parallel engine gets its own (dp_client)
        self._check_async_scheduling()
        return EngineConfig(
            model=self._sub_config(ModelConfig, resolved),
            cache=self._sub_config(CacheConfig, resolved),
            scheduler=self._sub_config(SchedulerConfig, resolved),
            speculative=SpeculativeConfig.from_dict(self.speculative_config),
            parallel=self._sub_config(ParallelConfig, resolved),
            kv_transfer=self._kv_transfer_config(),
            compilation=CompilationConfig.resolve(
                self.enforce_eager,
                self.cudagraph_capture_sizes,
                self.max_num_seqs,
                self.max_num_batched_tokens,
            ),
            structured_outputs=self._sub_config(StructuredOutputsConfig, resolved),
            lora=self._lora_config(resolved),
        )

    def _check_async_scheduling(self) -> None:
        """Drafts are proposed from the step's tokens, and a connector's transfers follow each
        step's blocks: both need the last step read before the next is scheduled."""
        if not self.async_scheduling:
            return
        if self.speculative_config is not None:
            raise ValueError(
                "async_scheduling (--async-scheduling) runs without speculative decoding"
            )
        if self.kv_transfer_config is not None:
            raise ValueError("async_scheduling (--async-scheduling) runs without a KV connector")

    def _lora_config(self, resolved: dict) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters run with tensor_parallel_size 1")
        if self.speculative_config is not None:
            raise ValueError("enable_lora: LoRA adapters run without speculative decoding")
        return self._sub_config(LoRAConfig, resolved)

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        config = KVTransferConfig.from_dict(self.kv_transfer_config)
        if config is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "kv_transfer_config: KV connectors run with tensor_parallel_size 1 "
                f"(got {self.tensor_parallel_size})"
            )
        return config

    def _sub_config(self, cls: type, resolved: dict):
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(
            **{name: resolved[name] if name in resolved else getattr(self, name) for name in names}
        )
