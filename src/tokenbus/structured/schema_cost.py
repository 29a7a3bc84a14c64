"""What a JSON schema will cost xgrammar to compile, estimated before compiling (L2).

xgrammar turns an object's optional properties into rules that each may be followed by any of
the later ones, and its compile time grows faster than the square of their number in one object
(`benchmarks/grammar_compile.py` measures it: a few thousand take minutes), while required
properties, enums and arrays of the same size compile in milliseconds. So the estimate is Σ k²
over the schema's objects, k being an object's optional properties; a cap on it refuses the
pathological schema at once, before any compile starts.
"""

from __future__ import annotations

from typing import Any


def optional_property_cost(schema: Any) -> int:
    """Σ k² over every object in `schema` (parsed JSON) that has `properties`, k of them not
    `required`. Walked without recursion: a hostile schema may nest deeper than Python's stack
    (its depth has its own cap; this one counts everything)."""
    cost = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            if not isinstance(required, list):
                required = []
            named = {name for name in required if isinstance(name, str)}
            optional = sum(1 for name in properties if name not in named)
            cost += optional * optional
        stack.extend(node.values())
    return cost
