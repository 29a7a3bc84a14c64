"""The executor seam: worker phases in order, the engine's block count is the minimum over
ranks, one config surface for parallel layouts, CLI flags derived from EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tests.fixtures.engine import FakeWorker, make_fake_setup
from tokenbus.cli.args import add_engine_args, engine_args_from
from tokenbus.config import ParallelConfig
from tokenbus.engine.core import EngineCore
from tokenbus.engine.executor import Executor, UniProcExecutor
from tokenbus.engine.setup import check_parallel_layout
from tokenbus.engine_args import EngineArgs
from tokenbus.protocol import EngineRequest
from tokenbus.sampling_params import SamplingParams


class RecordingWorker(FakeWorker):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.calls: list[str] = []

    def init_device(self) -> None:
        self.calls.append("init_device")

    def load_model(self) -> None:
        self.calls.append("load_model")

    def determine_num_kv_blocks(self) -> int:
        self.calls.append("determine_num_kv_blocks")
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.calls.append(f"initialize_kv_cache({num_blocks})")
        self.num_blocks = num_blocks


class TwoRankExecutor(Executor):
    """Ranks that measured different pools: the engine must hand both the smaller one."""

    def __init__(self, workers: list[RecordingWorker]) -> None:
        self.workers = workers

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def execute_model(self, scheduler_output):
        return [w.execute_model(scheduler_output) for w in self.workers][0]


def test_uniproc_runs_the_worker_phases_in_order():
    setup = make_fake_setup(num_kv_blocks=32)
    worker = RecordingWorker(32)
    engine = EngineCore(setup.config, None, setup.arch, setup.eos_token_id, worker=worker)
    assert worker.calls == [
        "init_device",
        "load_model",
        "determine_num_kv_blocks",
        "initialize_kv_cache(32)",
    ]
    assert engine.num_kv_blocks == 32 and isinstance(engine.executor, UniProcExecutor)
    with pytest.raises(ValueError, match="not a public worker method"):
        engine.executor.collective_rpc("_tokens")
    engine.executor.check_health()
    engine.shutdown()


def test_engine_takes_the_smallest_rank_pool_and_steps_all_ranks():
    setup = make_fake_setup(num_kv_blocks=40)
    workers = [RecordingWorker(40), RecordingWorker(24)]
    engine = EngineCore(
        setup.config, None, setup.arch, setup.eos_token_id, executor=TwoRankExecutor(workers)
    )
    assert engine.num_kv_blocks == 24 and engine.kv_cache_manager.block_pool.num_blocks == 24
    assert [w.calls[-1] for w in workers] == ["initialize_kv_cache(24)"] * 2
    engine.add_request(
        EngineRequest(
            request_id="r",
            prompt_token_ids=[5, 6, 7],
            sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
        )
    )
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step().outputs for t in out.new_token_ids]
    assert tokens == [8, 9, 10] and all(w.num_steps == 3 for w in workers)
    engine.check_integrity()


def test_parallel_config_resolves_and_validates():
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert (
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray").world_size == 2
    )
    for kwargs, match in [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1, got 0"),
        (dict(data_parallel_size=0), "data_parallel_size must be >= 1, got 0"),
        (dict(distributed_executor_backend="slurm"), "distributed_executor_backend must be one of"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'uni' runs one rank"),
    ]:
        with pytest.raises(ValueError, match=match):
            ParallelConfig(**kwargs)


def test_layouts_that_cannot_start_are_refused_at_the_front_door():
    arch = make_fake_setup().arch  # 1 head, 1 KV head, MLP 16
    check_parallel_layout(EngineArgs().to_config(256), arch)
    check_parallel_layout(EngineArgs(data_parallel_size=2).to_config(256), arch)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2 does not divide the 1 attention heads"
    ):
        check_parallel_layout(EngineArgs(tensor_parallel_size=2).to_config(256), arch)
    with pytest.raises(ValueError, match="ray_address '127.0.0.1:1': cannot reach"):
        check_parallel_layout(
            EngineArgs(distributed_executor_backend="ray", ray_address="127.0.0.1:1").to_config(
                256
            ),
            arch,
        )


def test_every_sub_config_field_comes_from_engine_args():
    config = EngineArgs(
        max_num_seqs=3,
        block_size=32,
        dtype="bfloat16",
        kv_cache_memory="1MiB",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    ).to_config(512)
    assert (config.scheduler.max_num_seqs, config.cache.block_size, config.model.dtype) == (
        3,
        32,
        "bfloat16",
    )
    assert config.cache.kv_cache_memory == 1 << 20 and config.model.max_model_len == 512
    assert (
        config.scheduler.max_model_len == 512
        and config.parallel.distributed_executor_backend == "ray"
    )


def test_cli_flags_are_derived_from_engine_args():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest for a in parser._actions} - {"help", "model"}
    fields = {f.name for f in dataclasses.fields(EngineArgs) if f.metadata.get("flag", True)}
    assert flags == fields and "multiprocess" not in flags and "tensor_parallel_size" in flags
    ns = parser.parse_args(
        [
            "m.gguf",
            "--dtype",
            "bfloat16",
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--kv-cache-memory",
            "1GiB",
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "64",
        ]
    )
    args = engine_args_from(ns)
    assert (args.model, args.dtype, args.enable_prefix_caching, args.enforce_eager) == (
        "m.gguf",
        "bfloat16",
        False,
        True,
    )
    assert (args.kv_cache_memory, args.tensor_parallel_size, args.max_model_len) == ("1GiB", 2, 64)
    assert engine_args_from(parser.parse_args([])) == EngineArgs()
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "slurm"])


def test_a_failed_engine_start_shuts_its_executor_down():
    class TooSmall(RecordingWorker):
        def determine_num_kv_blocks(self) -> int:
            raise ValueError("kv_cache_memory: too small for one request")

        def shutdown(self) -> None:
            self.calls.append("shutdown")

    setup = make_fake_setup(num_kv_blocks=32)
    worker = TooSmall(32)
    with pytest.raises(ValueError, match="too small for one request"):
        EngineCore(setup.config, None, setup.arch, setup.eos_token_id, worker=worker)
    assert worker.calls == ["init_device", "load_model", "shutdown"]
