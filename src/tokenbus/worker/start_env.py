"""What an engine process will run, judged before it starts, without torch (L3).

The front end chooses a spawned engine's OpenMP spin count (utils/cpu.engine_process_env) from
this guess. It imports neither torch nor the model, so the server can spawn the engine before
it imports torch itself and the two processes start side by side.
"""

from __future__ import annotations

from tokenbus.config import EngineConfig
from tokenbus.loader.gguf_file import read_gguf
from tokenbus.loader.source import ModelSource
from tokenbus.utils.cpu import CpuFeatures

# GGUF types the tile kernels (model/native/quant_tiles.c) run: Q8_0, Q4_0, Q4_1. The same as
# model.native.TILE_QTYPES, which imports torch; a test keeps the two equal.
TILE_QTYPES = (8, 2, 3)


def expects_c_decode_layers(config: EngineConfig, src: ModelSource | None) -> bool:
    """Whether an engine on this config will likely run its decode steps' layers in C
    (model/native/decode_layer.c), judged from the config, the GGUF header and the CPU: a wrong
    guess costs speed, never correctness. Device `auto` is taken to be the CPU (deciding needs
    torch); on a GPU the spin count hardly matters, its host threads seldom enter OpenMP."""
    if src is None or src.kind != "gguf":  # (an engine factory of its own may have no model file)
        return False
    model = config.model
    if (config.compilation.enforce_eager or model.device not in ("auto", "cpu")
            or config.parallel.tensor_parallel_size > 1 or model.dtype not in ("auto", "float32")
            or model.quantization == "none" or not CpuFeatures.detect().has("avx2", "fma", "f16c")):
        return False
    try:
        tensors = read_gguf(src.path).tensors.values()
    except (OSError, ValueError):
        return False
    layer_matrices = [t for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return bool(layer_matrices) and all(int(t.qtype) in TILE_QTYPES for t in layer_matrices)
