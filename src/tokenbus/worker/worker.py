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
    """One rank's device, model, KV cache and runner, built in the phases of WorkerBase
    (engine/executor/abstract.py): init_device → load_model → determine_num_kv_blocks →
    initialize_kv_cache(num_blocks), the block count chosen by the engine."""

    def __init__(self, config: EngineConfig, source: ModelSource, arch: ModelArch,
                 eos_token_id: int | None) -> None:
        self.config = config
        self.source = source
        self.arch = arch
        self.eos_token_id = eos_token_id
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = resolve_device(self.config.model.device)
        self.dtype = resolve_dtype(self.config.model.dtype, self.device)
        torch.manual_seed(self.config.model.seed)
        if self.device.type == "cpu":
            cpu = CpuFeatures.detect()
            logger.info("CPU: %s; %d torch threads", cpu.describe(), torch.get_num_threads())
            warning = cpu_dtype_warning(self.dtype, cpu)
            if warning:
                logger.warning(warning)

    def load_model(self) -> None:
        self.model = load_model(self.source, self.arch, self.dtype, self.device,
                                self.config.model.attention_backend)

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank can hold after its weights (what it measures, not what it gets)."""
        return determine_num_blocks(self.config.cache, self.arch, self.dtype, self.device,
                                    self.config.scheduler.max_model_len, self.config.scheduler.max_num_seqs)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        kv_caches = allocate_kv_caches(self.arch, num_blocks, self.config.cache.block_size, self.dtype,
                                       self.device)
        logger.info("KV cache: %d blocks of %d tokens (%s, %s)", num_blocks,
                    self.config.cache.block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.config, self.arch, self.model, kv_caches, self.device,
                                  self.eos_token_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        """A rank is healthy while it answers."""

    def shutdown(self) -> None:
        """Nothing to release for one in-process rank."""
