"""The offline LLM from places that have no importable main module, since engine processes
start from anywhere: a script on standard input, `python -c`, a script without a main guard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(model_dir: Path) -> str:
    # Top level, no `if __name__ == "__main__":` guard: the spawned EngineCore must not re-run it.
    return (
        "from tokenbus import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, max_model_len=64, num_kv_blocks=16)\n"
        "out = llm.generate([{'prompt_token_ids': [1, 2, 3]}],"
        " SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', len(out[0].outputs[0].token_ids))\n"
        "llm.shutdown()\n"
    )


@pytest.mark.parametrize("how", ["stdin", "dash-c", "unguarded-script"])
def test_llm_runs_without_an_importable_main(tiny_llama_dir, tmp_path, how):
    script = _script(tiny_llama_dir)
    if how == "stdin":
        cmd, stdin = [sys.executable, "-"], script
    elif how == "dash-c":
        cmd, stdin = [sys.executable, "-c", script], None
    else:
        path = tmp_path / "run.py"
        path.write_text(script)
        cmd, stdin = [sys.executable, str(path)], None
    result = subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TOKENS 3" in result.stdout
