"""Render docs/benchmarks.md's tables from the run records under benchmarks/results/.

    .venv/bin/python benchmarks/results_tables.py            # rewrite the generated sections
    .venv/bin/python benchmarks/results_tables.py --check    # exit 1 where the doc differs

Each `<!-- results:TOPIC -->` ... `<!-- /results:TOPIC -->` section of the doc is replaced by
one table of the records in benchmarks/results/TOPIC/ (format: src/tokenbus/bench/record.py).
Per topic, CPU and variant only the newest record shows; an older one stays in git. Every row
names its CPU and every table lists its runs: command, revision, date and the peers measured
in the same run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = re.compile(r"(<!-- results:(\S+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def load_records(results: Path = RESULTS) -> dict[str, list[dict]]:
    by_topic: dict[str, list[dict]] = {}
    for path in sorted(results.glob("*/*.json")):
        record = json.loads(path.read_text())
        if record["topic"] != path.parent.name:
            raise ValueError(f"{path}: topic {record['topic']!r} is not its folder's name")
        by_topic.setdefault(record["topic"], []).append(record)
    return by_topic


def current(records: list[dict]) -> list[dict]:
    """The newest record per (CPU, variant), ordered by CPU, then variant."""
    newest: dict[tuple[str, str], dict] = {}
    for r in records:
        key = (r["cpu"], r.get("variant", ""))
        if key not in newest or r["date"] >= newest[key]["date"]:
            newest[key] = r
    return [newest[k] for k in sorted(newest)]


def _cell(value, unit: str | None) -> str:
    if value is None:
        return ""
    return f"{value}×" if unit == "×" else str(value)


def _label(name: str, unit: str | None) -> str:
    return f"{name} ({unit})" if unit and unit != "×" else name


def render_topic(records: list[dict], machine: str = "CPU") -> str:
    """One topic's table; `machine` heads the first column (the GPU topics name their GPU)."""
    records = current(records)
    columns: list[str] = []
    for r in records:
        for cells in r["rows"].values():
            columns += [c for c in cells if c not in columns]
    units: dict[str, str] = {}
    for r in records:
        units = {**r.get("units", {}), **units}
    columns.sort(key=lambda c: units.get(c) == "×")  # ratios after the figures they compare
    has_variant = any(r.get("variant") for r in records)
    has_label = any(label for r in records for label in r["rows"])
    header = [machine, *(["setting"] if has_variant else []), *([""] if has_label else [])]
    header += [_label(c, units.get(c)) for c in columns] + ["run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n, r in enumerate(records, 1):
        for label, cells in r["rows"].items():
            row = [r["cpu"], *([r.get("variant", "")] if has_variant else [])]
            row += [_label(label, units.get(label))] if has_label else []
            ratio = "×" if units.get(label) == "×" else None
            row += [_cell(cells.get(c), units.get(c, ratio)) for c in columns] + [str(n)]
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for n, r in enumerate(records, 1):
        peers = "; peers in the same run: " + ", ".join(r["peers"]) if r.get("peers") else ""
        source = f"; {r['source']}" if r.get("source", "script") != "script" else ""
        lines.append(f"{n}. `{r['command']}` ({r['revision']}, {r['date']}{peers}{source})")
    return "\n".join(lines) + "\n"


def render_doc(doc: str, by_topic: dict[str, list[dict]]) -> str:
    seen = {m[1] for m in SECTION.findall(doc)}
    missing = sorted(set(by_topic) - seen)
    if missing:
        raise ValueError(f"records without a section in {DOC.name}: {', '.join(missing)}")

    def fill(match: re.Match) -> str:
        topic = match.group(2)
        machine = "GPU" if topic.startswith("gpu_") else "CPU"
        records = by_topic.get(topic)
        table = render_topic(records, machine) if records else "No record yet.\n"
        return match.group(1) + table + match.group(4)

    return SECTION.sub(fill, doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is stale")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    doc = args.doc.read_text()
    rendered = render_doc(doc, load_records(args.results))
    if args.check:
        if rendered == doc:
            return 0
        diff = difflib.unified_diff(
            doc.splitlines(), rendered.splitlines(), "doc", "records", lineterm="", n=1
        )
        print("\n".join(list(diff)[:60]))
        print(f"{args.doc} differs from {args.results}: run {Path(__file__).name}", file=sys.stderr)
        return 1
    if rendered != doc:
        args.doc.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
