"""Resolving a model and the engine configuration from user arguments (L4)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenbus.config import EngineArgs, EngineConfig, ModelArch
from tokenbus.utils.cpu import available_cpus
from tokenbus.loader import ModelSource, load_arch, load_generation_config, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSetup:
    config: EngineConfig
    source: ModelSource
    arch: ModelArch
    eos_token_id: int | None
    generation_config: dict


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    if requested is None:
        return arch.max_position_embeddings
    if requested > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's context length "
            f"({arch.max_position_embeddings})")
    return requested


def check_parallel_layout(config: EngineConfig, arch: ModelArch) -> None:
    """Refuse at the front door, naming the flag, a layout that cannot start: nothing is
    spawned for it."""
    from tokenbus.model.parallel import TensorParallel

    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    if parallel.distributed_executor_backend == "ray":
        raise ValueError("distributed_executor_backend 'ray' is not available yet: use 'mp'")
    if parallel.data_parallel_size != 1:
        raise ValueError(f"data_parallel_size={parallel.data_parallel_size} is not available yet: "
                         f"this build runs one engine")
    TensorParallel(0, tp).check_divides(arch)
    _check_devices_for(tp, config.model.device)


def _check_devices_for(tp: int, device: str) -> None:
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        if tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
        return
    cores = available_cpus()
    if tp > cores:
        logger.warning("tensor_parallel_size=%d ranks on %d cores: they will share cores (slower, "
                       "still correct)", tp, cores)


def create_engine_setup(args: EngineArgs) -> EngineSetup:
    """Resolve the model (metadata only) and freeze the configuration."""
    source = resolve_model(args.model)
    arch = load_arch(source)
    config = args.to_config(resolve_max_model_len(args.max_model_len, arch))
    check_parallel_layout(config, arch)
    generation_config = load_generation_config(source)
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and arch.eos_token_ids:
        eos = arch.eos_token_ids[0]
    return EngineSetup(config, source, arch, eos, generation_config)


def create_tokenizer(setup: EngineSetup):
    return load_tokenizer(setup.source, setup.config.model.tokenizer)
