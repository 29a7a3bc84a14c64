"""Engine flags shared by every subcommand, named like vLLM's (L7)."""

from __future__ import annotations

import argparse
import dataclasses

from tokenbus.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model directory, .gguf file, or 'smollm2' (default: the packaged "
                             "SmolLM2-135M-Instruct GGUF)")
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "native"],
                   help="auto: a native C kernel on CPU (float32/bfloat16) when it builds, else torch")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="bytes or a size like 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--num-kv-blocks", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"extra"}
    return EngineArgs(**{name: getattr(ns, name) for name in names if hasattr(ns, name)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace):
    from tokenbus.sampling_params import SamplingParams

    return SamplingParams(
        n=ns.n, max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        min_p=ns.min_p, repetition_penalty=ns.repetition_penalty, seed=ns.sampling_seed,
        stop=ns.stop, ignore_eos=ns.ignore_eos)
