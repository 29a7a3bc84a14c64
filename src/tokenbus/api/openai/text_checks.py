"""Is every string of a request valid Unicode text? (L5)

JSON may spell a UTF-16 surrogate on its own (`"\\ud800"`); Python then holds a str that no
UTF-8 encoder accepts, and the request would fail wherever it is first encoded — at the
engine's socket, after a stream's 200 was sent. Found here, it is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_lone_surrogate(value: Any) -> str | None:
    """The path (`stop[0]`, `messages[3].content`) of the first string that is not valid
    Unicode, keys included; None when all are. Walks without recursion: bodies may nest deep."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _is_text(node):
                return path or "body"
        elif isinstance(node, BaseModel):
            items = {**node.__dict__, **(node.model_extra or {})}
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in items.items())
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and not _is_text(k):
                    return f"{path} (a key)" if path else "body (a key)"
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None
