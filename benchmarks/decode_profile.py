"""Where one stream's decode step goes: cProfile of 129 greedy steps of the default model (or
--model's) with the EngineCore in this process (so the profile sees the model), after one
warm-up run.

    .venv/bin/python benchmarks/decode_profile.py [--model PATH] [--top 20] [--layer-by-layer]

--layer-by-layer drops the model's C decode layers (model/native/decode_layer.c), so every layer
runs its torch ops and kernel calls one by one, as before they existed. Also prints the step time
without the profiler (best of 3).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from tokenbus import LLM, SamplingParams
from tokenbus.utils.cpu import CpuFeatures


def profiled_generate(
    llm: LLM, request: list[dict], params: SamplingParams
) -> tuple[pstats.Stats, float]:
    """One llm.generate under cProfile: its statistics and its wall time (s)."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm.generate(request, params, use_tqdm=False)
    profile.disable()
    return pstats.Stats(profile), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--layer-by-layer", action="store_true")
    args = parser.parse_args()
    print(f"CPU: {CpuFeatures.detect().describe()}")
    llm = LLM(args.model, multiprocess=False, enable_prefix_caching=False, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=129, min_tokens=129, ignore_eos=True)
    request = [{"prompt_token_ids": [1234]}]
    if args.layer_by_layer:
        model = llm.engine.client.engine_core.executor.worker.model
        model.kernels = model.kernels.without_decode_layers()
    llm.generate(request, params, use_tqdm=False)  # warm-up
    plain = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(request, params, use_tqdm=False)
        plain.append(time.perf_counter() - start)
    print(f"without the profiler: {min(plain) / 129 * 1e3:.2f} ms a step (best of 3, 129 steps)")
    stats, elapsed = profiled_generate(llm, request, params)
    print(f"{129 / elapsed:.1f} tok/s, {elapsed / 129 * 1e3:.1f} ms a step (under the profiler)")
    stats.sort_stats("tottime").print_stats(args.top)
    llm.shutdown()


if __name__ == "__main__":
    main()
