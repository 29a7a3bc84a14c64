"""The layering rule (docs/architecture.md, "Package map"), checked by import-linter's
contracts in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: it comes with the dev extras (make install)")
    result = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
