"""Resolving a model and the engine configuration from user arguments (L4)."""

from __future__ import annotations

import logging
import os
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
            raise ValueError(f"tensor_parallel_size × data_parallel_size = {num_ranks} ranks need "
                             f"{num_ranks} GPUs; {torch.cuda.device_count()} visible")
        return
    cores = available_cpus()
    if num_ranks > cores:
        logger.warning("%d ranks (tensor_parallel_size × data_parallel_size) on %d cores: they will "
                       "share cores (slower, still correct)", num_ranks, cores)


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
