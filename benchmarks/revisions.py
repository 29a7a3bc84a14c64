"""A native kernel source as it was at another git revision, built beside today's: the
`--baseline REV` of quant_linear.py and attention_layer.py, which time two builds in turns in one
process."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from tokenbus.model.native import included_headers

REPO = Path(__file__).resolve().parents[1]


def load_at_revision(rev: str, source: Path, load):
    """load(path) on git revision `rev`'s copy of the C file `source` (in this repository), with
    the headers it includes beside it in a scratch folder; the object stays in the build cache."""

    def show(path: Path) -> bytes:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, check=True
        ).stdout

    relative = source.relative_to(REPO)

    def read(name: str) -> bytes:
        return show(relative.parent / name)

    with tempfile.TemporaryDirectory(prefix=f"{source.stem}-") as folder:
        for name in (source.name, *included_headers(read, source.name)):
            (Path(folder) / name).write_bytes(read(name))
        return load(Path(folder) / source.name)
