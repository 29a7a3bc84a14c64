"""The CPU captured step: the model's forward compiled by torch.compile, inductor's C++
backend (L3). CPUs have no graphs to replay; what a recorded step saves there is Python and
per-op dispatch, and what inductor fuses (norms, rotary, residual adds, SiLU * up).

Graphs: one static graph for batch size 1, and one graph with the batch dimension dynamic for
every larger capture size (measured as fast as one static graph per size, at one compile
instead of one per size). The native kernels run as custom ops (model/native/ops.py).
Replays skip dynamo's guard evaluation (`skip_guard_eval_unsafe`): a replay's inputs are the
persistent buffers at a captured shape, the model never changes, and the guards of a
30-layer model cost ~1 ms a step.

Compiled artifacts (inductor's FX graph cache and AOTAutograd cache) live under
tokenbus.utils.cache_dir()/inductor/torch-<version>-<isa>-<cpu flags hash>, unless $TORCHINDUCTOR_CACHE_DIR is
set; their keys cover the graph (model shape, dtype, sizes), inductor's configuration and the
compiler, so a second start loads instead of compiling (dynamo still traces the forward).
`compile_counters()` tells them apart (cache hits vs misses).
"""

from __future__ import annotations

import hashlib
import os

import torch

from tokenbus.config import EngineConfig
from tokenbus.utils import cache_dir
from tokenbus.utils.cpu import CpuFeatures
from tokenbus.worker.input_batch import PreparedBatch

# Inductor settings for the decode graph: size/alignment asserts cost ~0.3 ms a step in the
# generated wrapper and guard nothing we do not control.
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}


def inductor_cache_dir() -> str:
    """One directory per torch version and CPU (its ISA level and a hash of its flags, as the
    native kernels' cache is keyed): graphs compiled for one CPU are never offered to another."""
    cpu = CpuFeatures.detect()
    flags = hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest()[:12]
    return str(cache_dir() / "inductor" / f"torch-{torch.__version__}-{cpu.isa}-{flags}")


def use_tokenbus_compile_cache() -> None:
    """Point inductor's on-disk caches at tokenbus' cache. A user's $TORCHINDUCTOR_CACHE_DIR
    wins; inductor's own default (which it writes into the environment on first use) does not."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()


def configure_inductor() -> None:
    """Start-up costs measured on the 2-core machine, paid by every process that compiles:
    inductor probes each SIMD level /proc/cpuinfo lists by building and loading a test
    library in a child Python (~10 children, 1-4 s); we trust cpuinfo instead. Its pool of
    compile worker processes costs more to start than it saves on 2 cores."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = True
    if (os.cpu_count() or 1) <= 4:
        inductor_config.compile_threads = 1


def compile_counters() -> dict[str, int]:
    """Inductor's FX graph cache hits and misses in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {
        "fxgraph_cache_hit": inductor["fxgraph_cache_hit"],
        "fxgraph_cache_miss": inductor["fxgraph_cache_miss"],
    }


class CompiledCpuRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        import torch._dynamo

        use_tokenbus_compile_cache()
        configure_inductor()
        self.model = model
        sizes = config.compilation.cudagraph_capture_sizes
        # One entry per graph (size 1, the dynamic one); more would mean a shape we did not plan.
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, len(sizes) + 2
        )
        self._forward = torch.compile(model.forward, fullgraph=True, options=INDUCTOR_OPTIONS)
        self._captured: set[int] = set()

    def capture(self, size: int, batch: PreparedBatch) -> None:
        """Compile (or load from the cache) the graph `size` runs through, and run it once."""
        if size > 1:
            _mark_batch_dynamic(batch)
        self._forward(batch.input_ids, batch.ctx)
        self._captured.add(size)

    def replay(self, size: int, batch: PreparedBatch) -> torch.Tensor:
        assert size in self._captured, f"batch size {size} was not captured"
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._forward(batch.input_ids, batch.ctx)


def _mark_batch_dynamic(batch: PreparedBatch) -> None:
    """The token / request dimension of every per-step tensor is dynamic (>= 2: dynamo keeps
    sizes 0 and 1 static)."""
    import torch._dynamo

    ctx, plan = batch.ctx, batch.ctx.attn_metadata
    tensors = [
        batch.input_ids,
        ctx.positions,
        ctx.slot_mapping,
        ctx.block_tables,
        ctx.seq_lens_t,
        ctx.query_start_loc_t,
    ]
    tensors += [
        getattr(plan, name)
        for name in (
            "query_start",
            "seq_lens",
            "block_tables",
            "reqs",
            "token_requests",
            "positions",
        )
        if hasattr(plan, name)
    ]
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
