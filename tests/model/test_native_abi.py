"""The native kernels' C ABI, declared once in kernels.h, against its two other copies: the ctypes
table in signatures.py (argument by argument) and the ctypes structs of decode_layer.py and
decode_layer_weights.py (field by field). The compiler checks each .c file's definitions against
kernels.h; this checks Python."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from tokenbus.model import native
from tokenbus.model.native import decode_layer, decode_layer_weights
from tokenbus.model.native.signatures import SIGNATURES

NATIVE = Path(native.__file__).parent
_SCALARS = {"int64_t": "l", "int": "i", "float": "f", "void": "v"}


def _header() -> str:
    """kernels.h without its comments."""
    return re.sub(r"/\*.*?\*/", "", (NATIVE / "kernels.h").read_text(), flags=re.DOTALL)


def _letter(declaration: str) -> str:
    """One argument or field's letter: p for any pointer (function pointer types end in _fn),
    else its scalar's, else the struct type's name."""
    words = declaration.replace("*", " * ").split()
    if "*" in words or words[0].endswith("_fn"):
        return "p"
    base = [w for w in words if w != "const"][0]
    return _SCALARS.get(base, base)


def _prototypes() -> dict[str, tuple[str, str]]:
    found = {}
    for ret, name, args in re.findall(r"^(int64_t|int|void) (\w+)\((.*?)\);", _header(), re.M):
        params = [] if args.strip() == "void" else args.split(",")
        # Each parameter is "type name": drop the name, keep the type (and its stars).
        letters = "".join(_letter(re.sub(r"\w+\s*$", "", p.strip())) for p in params)
        found[name] = (_SCALARS[ret], letters)
    return found


def _structs() -> dict[str, list[tuple[str, str]]]:
    """Each `typedef struct { ... } name;` as its (field, letter) list, in order."""
    found = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", _header(), re.DOTALL):
        fields = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            first, *more = declaration.split(",")
            base, stars, field = re.match(r"^(.*?)\s*(\**)\s*(\w+)$", first.strip()).groups()
            fields.append((field, _letter(base + stars)))
            for other in more:
                stars, field = re.match(r"^\s*(\**)\s*(\w+)$", other).groups()
                fields.append((field, _letter(base + stars)))
        found[name] = fields
    return found


def test_header_is_parsed():
    """The parser sees what the header holds (a guard against a regex that matches nothing)."""
    structs = {"kernels", "shard", "linear", "moe", "mla", "per_layer_input", "layer"}
    structs |= {"kv_group", "step"}
    assert len(_prototypes()) >= 20 and set(_structs()) == structs


def test_signature_table_matches_header():
    assert _prototypes() == SIGNATURES


def test_every_exported_function_is_declared():
    """A non-static function defined in a .c file is in kernels.h (so ctypes can have a checked
    signature for it), and every .c file includes kernels.h (so the compiler checks it)."""
    declared = set(_prototypes())
    for source in NATIVE.glob("*.c"):
        text = source.read_text()
        assert '#include "kernels.h"' in text, source.name
        for name in re.findall(r"^(?:int64_t|int|void) (\w+)\(", text, re.M):
            assert name in declared, f"{source.name}: {name} is not in kernels.h"


_CTYPE_LETTERS = {ctypes.c_void_p: "p", ctypes.c_int64: "l", ctypes.c_float: "f", ctypes.c_int: "i"}
_STRUCTS = {
    "kernels": decode_layer._Kernels,
    "shard": decode_layer_weights._Shard,
    "linear": decode_layer_weights._Linear,
    "moe": decode_layer_weights._Moe,
    "mla": decode_layer_weights._Mla,
    "per_layer_input": decode_layer_weights._PerLayerInput,
    "layer": decode_layer_weights._Layer,
    "kv_group": decode_layer._KVGroup,
    "step": decode_layer._Step,
}


@pytest.mark.parametrize("name", sorted(_STRUCTS))
def test_ctypes_structs_match_header(name):
    c_names = {cls: c for c, cls in _STRUCTS.items()}
    fields = [
        (
            field,
            "p" if issubclass(kind, ctypes._Pointer) else _CTYPE_LETTERS.get(kind) or c_names[kind],
        )
        for field, kind in _STRUCTS[name]._fields_
    ]
    assert fields == _structs()[name]
