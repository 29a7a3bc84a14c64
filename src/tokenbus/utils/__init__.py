"""L0 helpers: stdlib only, import nothing else from tokenbus."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where tokenbus keeps what it builds once (kernels, converted tokenizers):
    $TOKENBUS_CACHE_DIR, else $XDG_CACHE_HOME/tokenbus, else ~/.cache/tokenbus."""
    root = os.environ.get("TOKENBUS_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenbus"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def parse_size(value: "int | float | str | None") -> int | None:
    """Parse a memory size: 1073741824, '1GiB', '512MiB', '2G', '1.5gb' → bytes."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 1 << 10,
        "m": 1 << 20,
        "g": 1 << 30,
        "t": 1 << 40,
        "b": 1,
    }
    for suffix, scale in units.items():  # noqa: B007 - `scale` is read after the break
        if text.endswith(suffix):
            number = text[: -len(suffix)]
            break
    else:
        number, scale = text, 1
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(
            f"kv_cache_memory: cannot parse size {value!r} (e.g. '1GiB', '512MiB')"
        ) from None
