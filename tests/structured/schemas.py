"""JSON schemas of varied shape for structured-output tests.

Every string is bounded (maxLength, enum, pattern or a fixed-size format) so that sampling at
temperature 1.0 can always finish within max_tokens. xgrammar ignores maxLength next to a
`format`, so unbounded formats such as "email" are left out.
"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}},
        "required": ["when"],
    },
    {
        "type": "object",
        "properties": {"ip": {"type": "string", "format": "ipv4"}},
        "required": ["ip"],
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 1, "maximum": 5},
            "b": {"type": "string", "maxLength": 5},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50}},
                "required": ["n"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]
            }
        },
        "required": ["value"],
    },
    {"type": "object", "properties": {"status": {"const": "done"}}, "required": ["status"]},
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 2,
                },
            }
        },
        "required": ["matrix"],
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 12},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["title", "pages"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "nested": {
                "type": "object",
                "properties": {
                    "deep": {
                        "type": "object",
                        "properties": {"v": {"type": "boolean"}},
                        "required": ["v"],
                        "additionalProperties": False,
                    }
                },
                "required": ["deep"],
                "additionalProperties": False,
            }
        },
        "required": ["nested"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["cat", "dog"]},
            "legs": {"type": "integer", "enum": [2, 4]},
        },
        "required": ["kind", "legs"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}},
        "required": ["price"],
    },
    {"type": "boolean"},
]
