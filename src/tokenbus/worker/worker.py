"""A worker owns a device: it loads the model, allocates the KV cache and runs steps (L3)."""

from __future__ import annotations

import logging

import torch

from tokenbus.config import EngineConfig, ModelArch
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.loader import ModelSource
from tokenbus.utils.cpu import BF16_DOT_FLAGS, CpuFeatures
from tokenbus.worker.model_loader import load_model
from tokenbus.worker.kv_cache import allocate_kv_caches, determine_num_blocks
from tokenbus.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was requested but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 GEMM measured ~4x slower there) and bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def cpu_dtype_warning(dtype: torch.dtype, cpu: CpuFeatures) -> str | None:
    """bf16 runs everywhere (portable kernels where oneDNN's packed path is refused), but on a
    CPU without bf16 dot products it is emulated and slower than float32: say so once."""
    if dtype == torch.bfloat16 and not cpu.has_bf16_dot:
        return (f"dtype bfloat16 on a CPU without bf16 instructions ({', '.join(BF16_DOT_FLAGS)}): "
                f"it runs correctly but emulated, slower than float32 (the CPU default)")
    return None


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, arch: ModelArch,
                 eos_token_id: int | None) -> None:
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        torch.manual_seed(config.model.seed)
        if self.device.type == "cpu":
            cpu = CpuFeatures.detect()
            logger.info("CPU: %s; %d torch threads", cpu.describe(), torch.get_num_threads())
            warning = cpu_dtype_warning(self.dtype, cpu)
            if warning:
                logger.warning(warning)
        model = load_model(source, arch, self.dtype, self.device, config.model.attention_backend)
        max_model_len = config.scheduler.max_model_len
        self.num_blocks = determine_num_blocks(config.cache, arch, self.dtype, self.device, max_model_len,
                                               config.scheduler.max_num_seqs)
        kv_caches = allocate_kv_caches(arch, self.num_blocks, config.cache.block_size, self.dtype,
                                       self.device)
        logger.info("KV cache: %d blocks of %d tokens (%s, %s)", self.num_blocks,
                    config.cache.block_size, self.dtype, self.device)
        self.runner = ModelRunner(config, arch, model, kv_caches, self.device, eos_token_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
