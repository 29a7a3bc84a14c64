"""A worker owns a device: it loads the model, allocates the KV cache and runs steps (L3)."""

from __future__ import annotations

import logging

import torch

from tokenbus.config import EngineConfig
from tokenbus.core.kv.hybrid import KVGroupLayout, engine_kv_groups, layer_windows
from tokenbus.core.outputs import ModelRunnerOutput, PendingOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.kv_transfer.factory import connector_context, make_worker_connector
from tokenbus.kv_transfer.layout import kv_layout
from tokenbus.loader import ModelSource
from tokenbus.model.kv_quant import kv_storage_dtype
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model_arch import ModelArch
from tokenbus.utils.cpu import BF16_DOT_FLAGS, CpuFeatures, available_cpus
from tokenbus.worker.captured_step import (
    CaptureDispatcher,
    CapturedSteps,
    capture_disabled_reason,
    capture_query_lens,
)
from tokenbus.worker.input_batch import InputBuffers, max_blocks_per_req
from tokenbus.worker.kv_cache import allocate_kv_caches, determine_num_blocks
from tokenbus.worker.model_builder import load_model
from tokenbus.worker.model_runner import ModelRunner
from tokenbus.worker.spec_decode.draft_model import DraftModel, load_draft_model
from tokenbus.worker.state_pool import allocate_state_pools, state_pool_bytes

logger = logging.getLogger(__name__)


def cpu_dtype_warning(dtype: torch.dtype, cpu: CpuFeatures) -> str | None:
    """bf16 runs everywhere (portable kernels where oneDNN's packed path is refused), but on a
    CPU without bf16 dot products it is emulated and slower than float32: say so once."""
    if dtype == torch.bfloat16 and not cpu.has_bf16_dot:
        return (
            f"dtype bfloat16 on a CPU without bf16 instructions ({', '.join(BF16_DOT_FLAGS)}): "
            f"it runs correctly but emulated, slower than float32 (the CPU default)"
        )
    return None


class Worker:
    """One rank's device, model, KV cache and runner, built in the phases of WorkerBase
    (engine/executor/abstract.py): init_device → load_model → determine_num_kv_blocks →
    initialize_kv_cache(num_blocks), the block count chosen by the engine."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        arch: ModelArch,
        eos_token_id: int | None,
        rank: int = 0,
        distributed_init_method: str | None = None,
        local_device_index: int | None = None,
    ) -> None:
        """`distributed_init_method` (tcp://host:port) joins the ranks of a tensor-parallel
        engine; one rank needs none. `local_device_index`: the GPU this rank uses when a
        scheduler (Ray) has already narrowed what it sees; default: one GPU per rank of the
        machine's, data_parallel_rank * tensor_parallel_size + rank. `config` is resolved
        (engine/setup.resolve_config): the worker reads its facts, it decides no `auto`."""
        if unresolved := config.unresolved_settings():
            raise ValueError(
                f"a Worker needs a resolved config (setup.resolve_config): {unresolved}"
            )
        self.config = config
        self.source = source
        self.arch = arch
        self.eos_token_id = eos_token_id
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.local_device_index = local_device_index
        self.tp = SINGLE
        self.model: torch.nn.Module | None = None
        self.draft: DraftModel | None = None  # a separate draft model, loaded with the target
        self.runner: ModelRunner | None = None

    @property
    def rank_arch(self) -> ModelArch:
        """This rank's share of the model's shape (its heads size its KV cache)."""
        return self.tp.shard_arch(self.arch)

    def init_device(self) -> None:
        self.device = torch.device(self.config.model.device)
        parallel = self.config.parallel
        if self.device.type == "cuda" and (
            parallel.world_size > 1 or parallel.data_parallel_size > 1
        ):
            # One GPU per rank: engine d's rank r takes GPU d * tp + r (before NCCL starts).
            index = self.local_device_index
            if index is None:
                index = parallel.data_parallel_rank * parallel.world_size + self.rank
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        if parallel.world_size > 1:
            self.tp = init_tensor_parallel(
                self.rank, parallel.world_size, self.distributed_init_method, self.device
            )
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(self.config))
        self.dtype = getattr(torch, self.config.model.dtype)
        self.kv_dtype = kv_storage_dtype(self.config.cache.kv_cache_dtype)
        torch.manual_seed(self.config.model.seed)
        if self.device.type == "cpu" and self.rank == 0:
            cpu = CpuFeatures.detect()
            logger.info("CPU: %s; %d torch threads", cpu.describe(), torch.get_num_threads())
            warning = cpu_dtype_warning(self.dtype, cpu)
            if warning:
                logger.warning(warning)

    def load_model(self) -> None:
        self.model = load_model(
            self.source,
            self.arch,
            self.dtype,
            self.device,
            self.config.model.attention_backend,
            self.tp,
            self.config.model.quantization,
            self.config.model.quant_activations,
            self.config.compilation.enforce_eager,
            self.config.model.load_format,
            self.config.model.seed,
            self.config.model.batch_invariant,
            self.config.scheduler.max_model_len,
        )
        check_layer_windows(self.model, self.arch)
        self.draft = load_draft_model(self.config, self.arch, self.model, self.device)

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank can hold after its weights (a draft model's too) and its CUDA
        graphs (what it measures, not what it gets)."""
        return determine_num_blocks(
            self.config.cache,
            self.rank_arch,
            self.kv_dtype,
            self.device,
            self.config.scheduler.max_model_len,
            self.config.scheduler.max_num_seqs,
            reserved_bytes=self._graph_memory_bytes() + self._state_pool_bytes(),
            groups=self.kv_groups,
            draft_arch=None if self.draft is None else self.tp.shard_arch(self.draft.arch),
        )

    def _state_pool_bytes(self) -> int:
        """Recurrent layers' state pools: a row for each request max_num_seqs lets run."""
        return state_pool_bytes(self.model, self.config.scheduler.max_num_seqs, self.dtype)

    @property
    def kv_groups(self) -> KVGroupLayout | None:
        """The hybrid KV cache's groups (core/kv/hybrid.py), or None: one table per request."""
        return engine_kv_groups(self.config, self.arch)

    def _graph_memory_bytes(self) -> int:
        """On CUDA with captured steps: what capturing the largest shape at each query length
        takes (the first of them sizes the graph pool), measured on a throwaway two-block KV
        cache (0 if that capture fails: the real one will say why). A draft model's graphs,
        in a pool of their own, are not counted."""
        if (
            self.device.type != "cuda"
            or capture_disabled_reason(self.config, self.device, self.model) is not None
        ):
            return 0
        from tokenbus.worker.cuda_graphs import CudaGraphRunner, profile_graph_memory

        config = self.config
        query_lens = capture_query_lens(config, self.model)
        largest = CaptureDispatcher(
            config.compilation.cudagraph_capture_sizes,
            query_lens,
            config.scheduler.max_num_batched_tokens,
        ).largest()
        # Those shapes' sizes at every query length whose tokens fit the largest: shapes the
        # real capture takes too, the largest of each among them.
        sizes = tuple(sorted({shape.num_reqs for shape in largest}))
        block_size = config.cache.block_size

        def capture_largest() -> CapturedSteps:
            kv_caches = allocate_kv_caches(
                self.rank_arch, 2, block_size, self.kv_dtype, self.device, self.kv_groups
            )
            buffers = InputBuffers(
                max(shape.num_tokens for shape in largest),
                sizes[-1],
                max_blocks_per_req(config),
                self.device,
                self.kv_groups,
            )
            steps = CapturedSteps(
                self.model,
                CudaGraphRunner(self.model, self.device),
                sizes,
                buffers,
                block_size,
                kv_caches,
                query_lens,
            )
            with torch.inference_mode():
                steps.capture_all()
            return steps

        try:
            graph_bytes = profile_graph_memory(capture_largest)
        except Exception as exc:  # noqa: BLE001 - reported by the real capture
            logger.debug("profiling CUDA graph memory failed: %s", exc)
            return 0
        logger.info(
            "CUDA graphs: %.1f MiB for the largest capture shapes %s, kept out of the KV budget",
            graph_bytes / 2**20,
            list(largest),
        )
        return graph_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        state_pools = allocate_state_pools(
            self.model, self.config.scheduler.max_num_seqs, self.dtype, self.device
        )
        kv_caches = allocate_kv_caches(
            self.rank_arch,
            num_blocks,
            self.config.cache.block_size,
            self.kv_dtype,
            self.device,
            self.kv_groups,
            state_pools,
        )
        # hybrid: layers share buffers; recurrent layers' state pools counted apart
        buffers = {id(t): t for i, t in enumerate(kv_caches) if i not in state_pools}.values()
        kv_bytes = sum(t.numel() * t.element_size() for t in buffers)
        logger.info(
            "KV cache: %d blocks of %d tokens (%s, %s)",
            num_blocks,
            self.config.cache.block_size,
            self.kv_dtype,
            self.device,
        )
        # KV tensors are zero-filled lazily by the OS: RSS grows as blocks are first written.
        logger.info(
            "memory: weights %.1f MiB, KV cache %.1f MiB (resident as blocks fill), "
            "peak RSS %.1f MiB",
            model_weight_bytes(self.model) / 2**20,
            kv_bytes / 2**20,
            peak_rss_bytes() / 2**20,
        )
        if state_pools:
            logger.info(
                "recurrent states: %d layers' pools of %d rows, %.1f MiB",
                len(state_pools),
                self.config.scheduler.max_num_seqs,
                self._state_pool_bytes() / 2**20,
            )
        self.kv_connector = None
        if self.config.kv_transfer is not None:
            ctx = connector_context(
                self.config.kv_transfer,
                kv_layout(self.config, self.rank_arch),
                self.config.parallel.data_parallel_rank,
            )
            self.kv_connector = make_worker_connector(ctx)
            self.kv_connector.register_kv_caches(kv_caches)
        self.runner = ModelRunner(
            self.config,
            self.arch,
            self.model,
            kv_caches,
            self.device,
            self.eos_token_id,
            self.kv_connector,
            self.draft,
        )
        self.runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Every rank runs the step (and samples the same tokens from the same gathered
        logits, so their request states stay equal); only rank 0 reports it."""
        output = self.runner.execute_model(scheduler_output)
        return output if self.rank == 0 else None

    def launch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """The step handed to the device; its sampled ids are read by `.result()` (the
        in-process executor's one rank)."""
        return self.runner.launch(scheduler_output)

    def check_health(self) -> None:
        """A rank is healthy while it answers."""

    def shutdown(self) -> None:
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.shutdown()
        if self.tp.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def check_layer_windows(model: torch.nn.Module, arch: ModelArch) -> None:
    """The scheduler plans KV groups from ModelArch.sliding_windows (core/kv/hybrid.py), the
    layers attend with their own sliding_window: they must agree, or a sliding group would hand
    back blocks a layer still reads."""
    built = [
        getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in model.layers
    ]
    planned = layer_windows(arch)
    if built != planned:
        raise ValueError(
            f"the layers' sliding windows {built} differ from ModelArch.sliding_windows {planned}"
        )


def cpu_threads(config: EngineConfig) -> int:
    """--num-threads, else each rank of each engine's share of the cores this process may use
    (its affinity mask and cgroup quota, which torch's own default ignores)."""
    if config.model.num_threads is not None:
        return config.model.num_threads
    ranks = config.parallel.world_size * config.parallel.data_parallel_size
    return max(1, available_cpus() // ranks)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds: parameters (a tensor shared by two modules
    counted once) and GGUF blocks kept quantized."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    for module in model.modules():
        quantized = module.quantized_weights() if hasattr(module, "quantized_weights") else []
        if hasattr(module, "quantized_tables"):  # embeddings kept in GGUF blocks
            quantized += module.quantized_tables()
        for weight in quantized:
            seen[weight.data.data_ptr()] = weight.data.numel()
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str | None, device: torch.device
) -> TensorParallel:
    """Join the engine's ranks: gloo on CPU, nccl on CUDA."""
    if init_method is None:
        raise ValueError("tensor parallelism needs a distributed_init_method (tcp://host:port)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size
    )
    return TensorParallel(rank, world_size, torch.distributed.group.WORLD)
