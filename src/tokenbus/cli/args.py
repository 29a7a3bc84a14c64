"""Engine flags shared by every subcommand, named like vLLM's (L7).

Derived from the EngineArgs fields (engine_args.py), the one list of engine options: a field
`max_num_seqs: int` with its help becomes `--max-num-seqs N`; a bool one a
`--flag/--no-flag` pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from tokenbus.engine_args import EngineArgs


def _flag_type(annotation) -> type:
    """The argparse type of a field: str when a union admits str (sizes, JSON), else its one
    non-None member."""
    members = (
        typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    )
    members = tuple(m for m in members if m is not type(None))
    return str if str in members else members[0]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory, .gguf file, or 'smollm2' (default: the packaged "
        "SmolLM2-135M-Instruct GGUF)",
    )
    g = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        meta = f.metadata
        if not meta.get("flag", True):
            continue
        help_text = argparse.SUPPRESS if meta.get("hidden") else meta.get("help")
        name = "--" + f.name.replace("_", "-")
        kind = _flag_type(hints[f.name])
        if kind is bool:
            g.add_argument(
                name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif meta.get("nargs"):
            g.add_argument(name, type=int, nargs=meta["nargs"], default=f.default, help=help_text)
        else:
            g.add_argument(
                name, type=kind, default=f.default, choices=meta.get("choices"), help=help_text
            )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
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
        n=ns.n,
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
