"""Where a prefill goes: one request of --prompt-len tokens (max_tokens 1) through the default
model (or --model's) with the EngineCore in this process, timed without the profiler (best of
--repeats), then once under cProfile, split into its parts: the linears (layers/linear.py's
Linear.forward, the kernel calls inside), attention (model/attention.py's paged_attention, the
K/V writes included), and the rest.

    .venv/bin/python benchmarks/prefill_profile.py [--model PATH] [--prompt-len 512] [--top 15]
        [--num-threads 1] [--quant-activations auto|int16|int8|bf16|q8_k]

Prefix caching is off, so every run computes the whole prompt.
"""

from __future__ import annotations

import argparse
import time

from decode_profile import profiled_generate  # benchmarks/ is sys.path[0] when run as a script
from tokenbus import LLM, SamplingParams
from tokenbus.utils.cpu import CpuFeatures

# The entry point of each part: (file, function) as cProfile names them; its cumulative time.
PARTS = {
    "linears": ("layers/linear.py", "forward"),
    "attention": ("model/attention.py", "paged_attention"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--quant-activations", default="auto", help="GGUF linears' activations")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--num-threads", type=int, help="the engine's CPU threads (default: the usable cores)"
    )
    args = parser.parse_args()
    print(f"CPU: {CpuFeatures.detect().describe()}")
    llm = LLM(
        args.model,
        multiprocess=False,
        enable_prefix_caching=False,
        num_threads=args.num_threads,
        max_model_len=4096,
        quant_activations=args.quant_activations,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    request = [{"prompt_token_ids": [(7 * i) % 40000 + 100 for i in range(args.prompt_len)]}]
    llm.generate(request, params, use_tqdm=False)  # warm-up
    plain = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate(request, params, use_tqdm=False)
        plain.append(time.perf_counter() - start)
    best = min(plain)
    print(
        f"without the profiler: {best * 1e3:.1f} ms, {args.prompt_len / best:.1f} prompt tok/s "
        f"(best of {args.repeats})"
    )
    stats, whole = profiled_generate(llm, request, params)
    parts = {
        part: sum(
            cumtime
            for (file, _, name), (_, _, _, cumtime, _) in stats.stats.items()
            if file.endswith(suffix) and name == function
        )
        for part, (suffix, function) in PARTS.items()
    }
    parts["other"] = whole - sum(parts.values())
    print(
        f"under the profiler: {whole * 1e3:.1f} ms; "
        + ", ".join(
            f"{part} {seconds * 1e3:.1f} ms ({seconds / whole:.0%})"
            for part, seconds in parts.items()
        )
    )
    stats.sort_stats("tottime").print_stats(args.top)
    llm.shutdown()


if __name__ == "__main__":
    main()
