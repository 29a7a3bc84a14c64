"""Resolving a model and the engine configuration from user arguments (L4)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenbus.config import (
    BLOCK_QUANTIZATIONS,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    QUANTIZED_KV_CACHE_DTYPES,
    EngineConfig,
    ModelConfig,
)
from tokenbus.engine_args import EngineArgs
from tokenbus.loader import (
    ModelSource,
    load_arch,
    load_generation_config,
    load_tokenizer,
    resolve_model,
    tokenizer_path,
)
from tokenbus.loader.hf_loader import hf_blocks_quantized, read_json
from tokenbus.loader.quant_config import prequantized
from tokenbus.loader.source import DEFAULT_MODEL_SAMPLING
from tokenbus.model_arch import ModelArch
from tokenbus.sampling_params import GENERATION_CONFIG_FIELDS
from tokenbus.utils.cpu import available_cpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSetup:
    config: EngineConfig
    source: ModelSource
    arch: ModelArch
    eos_token_id: int | None
    generation_config: dict  # the model's own generation_config.json ({} without one)
    # Sampling fields a request leaves out take these values (--generation-config); by name,
    # a subset of sampling_params.GENERATION_CONFIG_FIELDS.
    sampling_defaults: dict = field(default_factory=dict)
    # The model's other EOS ids (generation_config.json's list, else the config's or GGUF's,
    # after eos_token_id: Gemma's <end_of_turn>): each ends a request as EOS does.
    extra_eos_token_ids: tuple[int, ...] = ()


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    if requested is None:
        return arch.max_position_embeddings
    if requested > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's context length "
            f"({arch.max_position_embeddings})"
        )
    return requested


def check_parallel_layout(config: EngineConfig, arch: ModelArch) -> None:
    """Refuse at the front door, naming the flag, a layout that cannot start: nothing is
    spawned for it. One rank on the CPU (or on whatever `auto` finds) always fits, and is
    checked without importing torch or the model: the server starts the engine sooner."""
    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    if (
        tp * parallel.data_parallel_size == 1
        and parallel.distributed_executor_backend != "ray"
        and not config.model.device.startswith("cuda")
    ):
        return
    from tokenbus.model.parallel import TensorParallel

    if parallel.distributed_executor_backend == "ray":
        # Before anything starts: Ray installed, the cluster reachable.
        from tokenbus.engine.executor.ray_executor import check_ray_address, import_ray

        import_ray()
        if address := parallel.ray_address or os.environ.get("RAY_ADDRESS"):
            check_ray_address(address)
    TensorParallel(0, tp).check_divides(arch)
    _check_devices_for(tp * parallel.data_parallel_size, config.model.device)


def _check_devices_for(num_ranks: int, device: str) -> None:
    """tensor_parallel_size × data_parallel_size ranks in all: one GPU each, or CPU cores."""
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        if num_ranks > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size × data_parallel_size = {num_ranks} ranks need "
                f"{num_ranks} GPUs; {torch.cuda.device_count()} visible"
            )
        return
    cores = available_cpus()
    if num_ranks > cores:
        logger.warning(
            "%d ranks (tensor_parallel_size × data_parallel_size) on %d cores: they will "
            "share cores (slower, still correct)",
            num_ranks,
            cores,
        )


def create_engine_setup(args: EngineArgs) -> EngineSetup:
    """Resolve the model (metadata only) and freeze the configuration."""
    source = resolve_model(args.model)
    arch = load_arch(source)
    config = args.to_config(resolve_max_model_len(args.max_model_len, arch))
    config = resolve_recurrent_layers(config, arch)
    check_parallel_layout(config, arch)
    if config.model.tokenizer is not None:
        tokenizer_path(config.model.tokenizer)
    generation_config = load_generation_config(source)
    eos_ids = _eos_token_ids(generation_config.get("eos_token_id")) or arch.eos_token_ids
    eos = eos_ids[0] if eos_ids else None
    defaults = sampling_defaults(
        args.generation_config, args.override_generation_config, source, generation_config
    )
    return EngineSetup(config, source, arch, eos, generation_config, defaults, eos_ids[1:])


def resolve_recurrent_layers(config: EngineConfig, arch: ModelArch) -> EngineConfig:
    """A model with recurrent layers (model/recurrent.py: LFM2's short convolutions, Mamba2
    mixers, Gated DeltaNet) builds each request's state from its first token, in one stream:
    prefix caching is turned off (a hit would skip the tokens the state is made of), and what
    reuses or rolls back computed tokens is refused by its flag: speculative decoding (its
    drafts would enter the state before they are verified) and KV transfer (a state does not
    travel with the blocks). Mamba2 and Gated DeltaNet layers run on one rank: tensor
    parallelism is refused for them."""
    if not arch.recurrent_layers:
        return config
    one_rank = "Mamba2" if arch.mamba_heads else "Gated DeltaNet" if arch.delta_v_heads else None
    if one_rank and config.parallel.tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size {config.parallel.tensor_parallel_size} is not supported for "
            f"{arch.architecture}: its {one_rank} layers run on one rank"
        )
    for flag, setting in (
        ("speculative_config", config.speculative),
        ("kv_transfer_config", config.kv_transfer),
    ):
        if setting is not None:
            raise ValueError(
                f"{flag} is not supported for {arch.architecture}: its recurrent layers "
                "keep a state per request"
            )
    config = _cap_running_states(config, arch)
    if not config.cache.enable_prefix_caching:
        return config
    logger.info(
        "prefix caching off: %s's recurrent layers keep a state per request that a cache "
        "hit would skip",
        arch.architecture,
    )
    cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
    return dataclasses.replace(config, cache=cache)


def _cap_running_states(config: EngineConfig, arch: ModelArch) -> EngineConfig:
    """max_num_seqs lowered so that the running requests' states (a pool row each, allocated
    up front: worker/state_pool.py) take at most half the KV budget, counted at 4 bytes a value
    (fp32, the CPU's; half that in bf16). A Mamba2 state is large: Granite-4.0-H-1B's is 55 MiB
    a request in fp32. On CUDA without --kv-cache-memory the budget is profiled later: no cap."""
    budget = config.cache.kv_cache_memory
    if budget is None and config.model.device.startswith("cuda"):
        return config
    per_request = 4 * arch.state_size_per_request
    rows = max(1, (budget or DEFAULT_CPU_KV_CACHE_MEMORY) // 2 // max(per_request, 1))
    scheduler = config.scheduler
    if rows >= scheduler.max_num_seqs:
        return config
    logger.warning(
        "max_num_seqs %d lowered to %d: each running request's recurrent state takes %.1f MiB "
        "(raise --kv-cache-memory for more)",
        scheduler.max_num_seqs,
        rows,
        per_request / 2**20,
    )
    return dataclasses.replace(config, scheduler=dataclasses.replace(scheduler, max_num_seqs=rows))


def _eos_token_ids(value) -> tuple[int, ...]:
    """generation_config's eos_token_id (an id or a list of them) as a tuple of unique ids."""
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    return tuple(dict.fromkeys(ids))


def sampling_defaults(
    mode: str, overrides: dict | str | None, source: ModelSource, model_generation_config: dict
) -> dict:
    """The sampling defaults --generation-config and --override-generation-config name."""
    if mode == "auto":
        given = dict(DEFAULT_MODEL_SAMPLING) if source.is_default_model else model_generation_config
    elif mode == "vllm":
        given = {}
    else:
        path = Path(mode).expanduser()
        path = path / "generation_config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                f"generation_config: expected auto, vllm, or a directory or file with a "
                f"generation_config.json; {mode!r} is none of them"
            )
        given = read_json(path)
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError as exc:
            raise ValueError(f"override_generation_config: not JSON: {exc}") from None
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError("override_generation_config: expected a JSON object")
    unknown = sorted(set(overrides or {}) - GENERATION_CONFIG_FIELDS.keys())
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown fields {unknown}; known: "
            f"{sorted(GENERATION_CONFIG_FIELDS)}"
        )
    merged = {**given, **(overrides or {})}
    return {
        name: merged[name]
        for name in GENERATION_CONFIG_FIELDS
        if isinstance(merged.get(name), (int, float)) and not isinstance(merged.get(name), bool)
    }


def resolve_config(config: EngineConfig, source: ModelSource | None) -> EngineConfig:
    """A new config whose RESOLVED_SETTINGS (config.py) are facts: device "cpu"/"cuda[:i]",
    dtype and kv_cache_dtype a dtype name, quantization "gguf"/"q8_0"/"none", attention_backend
    "native"/"torch". The workers, the scheduler and the connectors read them as they are.

    Runs once per engine, where the EngineCore is built (engine/core.py): it asks torch
    whether a GPU is there and may build the native kernels to learn whether they run, work
    that stays off the front end's start-up. `source` None (tests' fake engines): no weights.
    """
    model, cache = config.model, config.cache
    device = resolve_device(model.device)
    dtype = resolve_dtype(model.dtype, device)
    load_format = resolve_load_format(model.load_format, source)
    if load_format == "dummy":  # random dense weights: no GGUF blocks to keep
        if model.quantization in BLOCK_QUANTIZATIONS:
            raise ValueError(
                f"quantization {model.quantization!r} needs real weights, not load_format dummy"
            )
        quantization = "none"
    else:
        quantization = resolve_quantization(
            model.quantization, source, device, config.parallel.tensor_parallel_size
        )
    model = dataclasses.replace(
        model,
        device=device,
        dtype=dtype,
        quantization=quantization,
        attention_backend=resolve_attention_backend(
            model.attention_backend, device, dtype, cache.block_size
        ),
        load_format=load_format,
    )
    kv_cache_dtype = resolve_kv_cache_dtype(
        cache.kv_cache_dtype, device, dtype, quantization, model.attention_backend
    )
    cache = dataclasses.replace(cache, kv_cache_dtype=kv_cache_dtype)
    if model.batch_invariant:
        model = resolve_batch_invariant(model, kv_cache_dtype, with_lora=config.lora is not None)
    return dataclasses.replace(config, model=model, cache=cache)


def resolve_batch_invariant(
    model: ModelConfig, kv_cache_dtype: str, with_lora: bool = False
) -> ModelConfig:
    """--batch-invariant's requirements, each refused by name where unmet, and quant_activations
    auto made int16 (one mode at every size, the integer mode closest to fp32)."""
    if with_lora:  # its side path is torch GEMMs over the step's rows (model/lora.py)
        raise ValueError("batch_invariant does not cover LoRA adapters (enable_lora)")
    wanted = (
        ("device", model.device.split(":")[0], "cpu"),
        ("dtype", model.dtype, "float32"),
        ("attention_backend", model.attention_backend, "native"),
    )
    for name, value, need in wanted:
        if value != need:
            raise ValueError(
                f"batch_invariant runs on its CPU kernels: it needs {name} {need!r}, got {value!r}"
            )
    if kv_cache_dtype not in ("float32", "float16"):
        raise ValueError(
            "batch_invariant reads K/V in float32 or float16 (kv_cache_dtype), "
            f"got {kv_cache_dtype!r}"
        )
    if model.quant_activations == "auto" and model.quantization in BLOCK_QUANTIZATIONS:
        model = dataclasses.replace(model, quant_activations="int16")
    logger.info(
        "batch invariant: linears on row-independent kernels (GGUF activations: %s), every "
        "attention query by the decode kernel",
        model.quant_activations,
    )
    return model


def resolve_load_format(requested: str, source: ModelSource | None) -> str:
    """auto: the format of the model's files ("safetensors" for a directory, "gguf" for a GGUF
    file); "dummy" without a source (tests' fake engines load nothing). An explicit format
    that is not the files' is refused."""
    if requested == "dummy":
        return "dummy"
    if source is None:
        return "dummy" if requested == "auto" else requested
    found = "gguf" if source.kind == "gguf" else "safetensors"
    if requested not in ("auto", found):
        raise ValueError(f"load_format {requested!r}: {source.path} holds {found} weights")
    return found


def resolve_device(name: str) -> str:
    """auto: cuda when torch sees a GPU, else cpu. A data-parallel or tensor-parallel rank
    picks its own GPU index later (worker.init_device)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)  # a malformed name fails here, naming itself
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was requested but no CUDA device is available")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """auto: float32 on CPU (bf16 GEMM is slower there: benchmarks/cpu_speed.py --dtype),
    bfloat16 on CUDA."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return name


def quantization_problem(source: ModelSource | None, device: str, tp_size: int) -> str | None:
    """Why GGUF weights (or gpt-oss's MXFP4 safetensors) cannot stay quantized here, or None."""
    if source is None or not (source.kind == "gguf" or hf_blocks_quantized(source.path)):
        return "the model is not a GGUF file"
    return blocks_problem(device, tp_size)


def blocks_problem(device: str, tp_size: int) -> str | None:
    """Why linears cannot run on GGUF blocks here (whatever their source), or None."""
    if not device.startswith("cpu"):
        return f"the quantized kernels run on CPU, not {device}"
    if tp_size > 1:
        return "GGUF blocks are not split for tensor parallelism"
    return None


def resolve_quantization(
    requested: str, source: ModelSource | None, device: str | object, tp: int = 1
) -> str:
    """ "gguf", "q8_0" or "none". auto picks gguf where it can run and the kernels build (a
    quantized safetensors checkpoint: q8_0, _prequantized_quantization); an explicit gguf or
    q8_0 that cannot run is a ValueError with the reason. `device`: a name or torch.device."""
    if requested == "none":
        return "none"
    device = str(device)
    if requested == "q8_0":  # any source: its dense linears are rounded at load
        problem = blocks_problem(device, tp) or _kernels_problem()
        if problem is not None:
            raise ValueError(f"quantization 'q8_0': {problem}; use --quantization none")
        return "q8_0"
    if _prequantized(source):
        return _prequantized_quantization(requested, device, tp)
    problem = quantization_problem(source, device, tp) or _kernels_problem()
    if problem is None:
        return "gguf"
    if requested == "gguf":
        raise ValueError(f"quantization 'gguf': {problem}; use --quantization none")
    if source is not None and source.kind == "gguf" and device.startswith("cpu"):
        logger.warning("GGUF weights are dequantized: %s", problem)
    return "none"


def _prequantized(source: ModelSource | None) -> bool:
    """Whether an HF checkpoint's linears are quantized (loader/quant_config.py)."""
    if source is None or source.kind != "hf" or not (source.path / "config.json").is_file():
        return False
    config = source.path / "config.json"
    return prequantized(read_json(config), config)


def _prequantized_quantization(requested: str, device: str, tp: int) -> str:
    """A quantized (FP8, GPTQ, AWQ, compressed-tensors, bitsandbytes) checkpoint under auto:
    q8_0 where those kernels run (GPTQ's, AWQ's and compressed-tensors' 4-bit and symmetric
    8-bit integers and bitsandbytes' int8 rows kept as the GGUF blocks that hold them,
    loader/int_weights.py and loader/bnb.py; the rest, NF4 too, rounded to Q8_0 blocks),
    else dequantized to --dtype (a GPU's bf16). It is no GGUF: gguf is refused."""
    if requested == "gguf":
        raise ValueError(
            "quantization 'gguf': the model is not a GGUF file (a quantized safetensors "
            "checkpoint: use --quantization q8_0 or none)"
        )
    problem = blocks_problem(device, tp) or _kernels_problem()
    if problem is not None:
        if device.startswith("cpu"):
            logger.warning(
                "quantized safetensors are dequantized to the model's dtype: %s", problem
            )
        return "none"
    logger.info("quantized safetensors run on GGUF blocks (--quantization none: --dtype)")
    return "q8_0"


def _kernels_problem() -> str | None:
    from tokenbus.model.native import NativeBuildError, load_quant_kernels

    try:
        load_quant_kernels()
    except NativeBuildError as exc:
        return f"the quantized kernels cannot be built ({exc})"
    return None


def resolve_attention_backend(requested: str, device: str, dtype: str, block_size: int = 16) -> str:
    """ "native", "triton" or "torch": auto is Triton on CUDA where triton imports, else what
    model/attention_backend.select_attention_kernel picks (the native kernel on CPU in
    float32/bfloat16 when it builds). An explicit backend that cannot run is a ValueError
    with the reason."""
    if requested == "torch":
        return "torch"
    if requested == "triton" or (requested == "auto" and device.startswith("cuda")):
        from tokenbus.model.attention_backend import triton_problem

        problem = triton_problem(device, block_size)
        if problem is None:
            return "triton"
        if requested == "triton":
            raise ValueError(f"attention_backend 'triton': {problem}")
        logger.warning("Triton attention unavailable (%s); using the torch path", problem)
        return "torch"
    import torch

    from tokenbus.model.attention_backend import select_attention_kernel

    kernel = select_attention_kernel(requested, torch.device(device), getattr(torch, dtype))
    return "torch" if kernel is None else "native"


def resolve_kv_cache_dtype(
    requested: str, device: str, dtype: str, quantization: str, attention_backend: str = "torch"
) -> str:
    """auto: float16 for a float32 model on GGUF blocks on CPU, whose batched decode steps
    read mostly K/V from memory and whose 4-8-bit weights already round more than fp16 does
    (benchmarks/step_breakdown.py kv_cache_dtype=float32 measures the other); else the
    model's dtype. "fp8" is vLLM's name for fp8_e4m3. fp8 K/V run with the Triton kernels
    (read in place), and on CPU with the native kernel (likewise) or the torch path (which
    dequantizes what it gathers); q8_0 K/V run on CPU alone."""
    if requested == "fp8":
        requested = "fp8_e4m3"
    if attention_backend == "triton":
        runs_here = requested.startswith("fp8")
    else:
        runs_here = device.startswith("cpu")
    if requested in QUANTIZED_KV_CACHE_DTYPES and not runs_here:
        raise ValueError(
            f"kv_cache_dtype {requested!r} runs on CPU with the native or torch attention"
            + (", fp8 with the Triton kernels too" if requested.startswith("fp8") else "")
            + f", not on {device} with attention_backend {attention_backend!r}"
        )
    if requested != "auto":
        return requested
    if device.startswith("cpu") and dtype == "float32" and quantization in BLOCK_QUANTIZATIONS:
        return "float16"
    return dtype


def create_tokenizer(setup: EngineSetup):
    return load_tokenizer(setup.source, setup.config.model.tokenizer)
