"""The CUDA captured step: one CUDA graph per capture size (L3).

Captured at warm-up, largest size first, all graphs in one memory pool (a smaller graph's
activations fit in what the largest one reserved). Each capture is preceded by eager runs of
the same step (allocator warm-up, lazy initialisation), with the garbage collector frozen so
no Python-side free lands inside a capture. Inputs are the persistent device buffers (the
runner copies each step's inputs into them before a replay), outputs the graph's own static
tensor, sliced by the caller. Sampling stays outside the graph.

Graph memory is counted before the KV cache is sized: `profile_graph_memory` captures the
largest size against a throwaway cache and reports what the pool took (Worker subtracts it
from the KV budget).

Written device-agnostically next to the CPU path but never run here: no GPU on the machines
this was written on (benchmarks/gpu_check.sh runs it where there is one).
"""

from __future__ import annotations

import gc

import torch

from tokenbus.worker.input_batch import PreparedBatch, StepShape

NUM_WARMUP_RUNS = 2  # eager runs before each capture


class CudaGraphRunner:
    def __init__(
        self, model: torch.nn.Module, device: torch.device, num_layers: int | None = None
    ) -> None:
        self.model = model
        self.device = device
        self.num_layers = num_layers  # a self-drafting proposer's first layers (None: all)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[StepShape, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[StepShape, torch.Tensor] = {}
        # Warm-ups run on one side stream for every size (a stream per size would each get a
        # cuBLAS workspace of its own).
        self.warmup_stream = torch.cuda.Stream(self.device)

    def capture(self, shape: StepShape, batch: PreparedBatch) -> None:
        stream = self.warmup_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(NUM_WARMUP_RUNS):
                self.model(batch.input_ids, batch.ctx, num_layers=self.num_layers)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        gc.freeze()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[shape] = self.model(
                    batch.input_ids, batch.ctx, num_layers=self.num_layers
                )
        finally:
            gc.unfreeze()
        self.graphs[shape] = graph

    def replay(self, shape: StepShape, batch: PreparedBatch) -> torch.Tensor:
        # batch's tensors are views of the buffers the graph was captured with (prepare_batch
        # copied this step's inputs into them on the current stream).
        self.graphs[shape].replay()
        return self.outputs[shape]


def profile_graph_memory(make_steps) -> int:
    """Device bytes a capture takes: `make_steps()` builds and captures the largest size (on a
    throwaway KV cache); what the device lost meanwhile is the answer."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    steps = make_steps()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    del steps
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, free_before - free_after)
