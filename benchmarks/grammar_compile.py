"""How long xgrammar takes to compile a JSON schema, by its shape: the calibration of the
front door's compile-cost cap (`--max-schema-cost`, structured/schema_cost.py).

For k = 100 … 1,600 properties in one object, the compile time (one thread, as in the check
processes) when all k are optional, and when all are required, against the estimate Σ k².

    .venv/bin/python benchmarks/grammar_compile.py [--counts 100 400 800 1600] [--record DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 200, 400, 800, 1000, 1600])
    parser.add_argument("--record", default=None, metavar="DIR")
    args = parser.parse_args()

    import xgrammar as xgr

    from tokenbus.loader.source import resolve_model
    from tokenbus.loader.tokenizer import load_tokenizer
    from tokenbus.structured.backend import tokenizer_info
    from tokenbus.structured.schema_cost import optional_property_cost

    info = tokenizer_info(load_tokenizer(resolve_model(None)), 49152)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def seconds(schema: dict) -> float:
        start = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return time.perf_counter() - start

    rows = {}
    for count in args.counts:
        properties = {f"p{i}": {} for i in range(count)}
        optional = {"type": "object", "properties": properties}
        required = {**optional, "required": list(properties)}
        rows[f"{count} properties"] = {
            "estimate Σk²": optional_property_cost(optional),
            "all optional": round(seconds(optional), 3),
            "all required": round(seconds(required), 3),
        }
        print(f"{count}: {rows[f'{count} properties']}", flush=True)
    if args.record:
        from tokenbus.bench.record import make_record, this_command, write_record

        entry = make_record(
            "grammar_compile",
            this_command(),
            rows,
            units={"all optional": "s", "all required": "s"},
            variant="xgrammar, 1 thread, SmolLM2 vocabulary",
        )
        write_record(args.record, entry)


if __name__ == "__main__":
    main()
