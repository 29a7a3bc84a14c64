"""Where one stream's decode step goes: cProfile of 129 greedy steps of the default model with
the EngineCore in this process (so the profile sees the model), after one warm-up run.

    .venv/bin/python benchmarks/decode_profile.py [--top 20]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from tokenbus import LLM, SamplingParams
from tokenbus.utils.cpu import CpuFeatures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    print(f"CPU: {CpuFeatures.detect().describe()}")
    llm = LLM(multiprocess=False, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=129, min_tokens=129, ignore_eos=True)
    request = [{"prompt_token_ids": [1234]}]
    llm.generate(request, params, use_tqdm=False)  # warm-up
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm.generate(request, params, use_tqdm=False)
    profile.disable()
    elapsed = time.perf_counter() - start
    print(f"{129 / elapsed:.1f} tok/s, {elapsed / 129 * 1e3:.1f} ms a step (under the profiler)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    llm.shutdown()


if __name__ == "__main__":
    main()
