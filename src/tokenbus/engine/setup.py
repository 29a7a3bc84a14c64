"""Resolving a model and the engine configuration from user arguments (L4)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenbus.config import EngineArgs, EngineConfig, ModelArch
from tokenbus.loader import (
    ModelSource,
    load_arch,
    load_generation_config,
    load_tokenizer,
    resolve_model,
    tokenizer_path,
)
from tokenbus.loader.hf_loader import read_json
from tokenbus.loader.source import DEFAULT_MODEL_SAMPLING
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
    check_parallel_layout(config, arch)
    if config.model.tokenizer is not None:
        tokenizer_path(config.model.tokenizer)
    generation_config = load_generation_config(source)
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and arch.eos_token_ids:
        eos = arch.eos_token_ids[0]
    defaults = sampling_defaults(
        args.generation_config, args.override_generation_config, source, generation_config
    )
    return EngineSetup(config, source, arch, eos, generation_config, defaults)


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


def create_tokenizer(setup: EngineSetup):
    return load_tokenizer(setup.source, setup.config.model.tokenizer)
