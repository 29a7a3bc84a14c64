"""User-supplied text in log lines (L0): escaped so it cannot forge lines, truncated so it
cannot flood the log."""

from __future__ import annotations

DEFAULT_LIMIT = 200


def log_safe(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """`value` as one line of printable ASCII: control characters, non-ASCII and lone
    surrogates escaped (`\\n`, `\\xe9`, `\\ud800`); at most `limit` characters of it kept."""
    text = value if isinstance(value, str) else str(value)
    suffix = ""
    if len(text) > limit:
        suffix = f"...(+{len(text) - limit} chars)"
        text = text[:limit]
    return text.encode("unicode_escape").decode("ascii") + suffix
