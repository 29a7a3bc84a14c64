"""`tokenbus serve / proxy / generate / chat / bench / top` (L7): argument parsing, then
hand-off."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenbus.cli.args import (
    add_engine_args,
    add_sampling_args,
    engine_args_from,
    sampling_params_from,
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    if not hasattr(ns, "func"):
        parser.print_help()
        return 2
    try:
        return ns.func(ns) or 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenbus", description="LLM inference and serving")
    sub = parser.add_subparsers()

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming to the terminal")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None)
    chat.set_defaults(func=_chat)

    from tokenbus.cli.bench_cmd import add_bench_parser
    from tokenbus.cli.proxy_cmd import add_proxy_parser
    from tokenbus.cli.serve_cmd import add_serve_parser
    from tokenbus.cli.top_cmd import add_top_parser

    add_serve_parser(sub)
    add_proxy_parser(sub)
    add_bench_parser(sub)
    add_top_parser(sub)
    return parser


def _generate(ns: argparse.Namespace) -> int:
    from tokenbus.api.llm import LLM

    llm = LLM.from_engine_args(engine_args_from(ns))
    params = sampling_params_from(ns)
    if ns.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in ns.prompt], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(ns.prompt, params, use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            print(f"--- {output.prompt!r} [{completion.finish_reason}]")
            print(completion.text)
    return 0


def _chat(ns: argparse.Namespace) -> int:
    from tokenbus.cli.chat_cmd import run_chat

    return run_chat(engine_args_from(ns), sampling_params_from(ns), ns.system)


if __name__ == "__main__":
    sys.exit(main())
