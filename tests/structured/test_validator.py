"""The front-door grammar check: compiles run in processes that are killed at their deadline, so
slow specs neither hold slots nor cores, and their outcome is remembered."""

from __future__ import annotations

import contextvars
import json
import threading
import time

import psutil
import pytest

from tokenbus.sampling_params import StructuredOutputsParams
from tokenbus.structured.compile_pool import CheckCancelled, CompileCapacityError
from tokenbus.structured.schema_cost import optional_property_cost
from tokenbus.structured.validator import CHECK_CANCELLED, StructuredOutputValidator, spec_key


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_models import smollm2_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))


@pytest.fixture
def make_validator(tokenizer):
    made = []

    def make(**kwargs) -> StructuredOutputValidator:
        validator = StructuredOutputValidator(tokenizer, 49152, **kwargs)
        validator.validate(StructuredOutputsParams(choice=["warm"]))  # start the pool
        made.append(validator)
        return validator

    yield make
    for validator in made:
        validator.close()


def slow_grammar(count: int, title: str = "wide") -> StructuredOutputsParams:
    """An EBNF grammar that takes xgrammar seconds to compile: the one xgrammar writes for an
    object of `count` optional properties (the JSON-schema cost cap does not see grammars)."""
    import xgrammar as xgr

    schema = {"title": title, "type": "object", "properties": {f"p{i}": {} for i in range(count)}}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    # The title changes no rule: an unused rule named after it keeps specs distinct.
    return StructuredOutputsParams(grammar=f'{grammar}\nunused_{title} ::= "{title}"\n')


def child_pids() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def busy_children(among: set[int], seconds: float = 0.5) -> list[psutil.Process]:
    """Those of the child processes `among` still alive that used CPU over `seconds`. Only the
    processes that ran the checks count: their replacements may still be starting up."""
    children = [c for c in psutil.Process().children(recursive=True) if c.pid in among]
    before = {}
    for child in children:
        try:
            before[child.pid] = sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    time.sleep(seconds)
    busy = []
    for child in children:
        try:
            if sum(child.cpu_times()[:2]) - before.get(child.pid, 0.0) > 0.1 * seconds:
                busy.append(child)
        except psutil.NoSuchProcess:
            pass
    return busy


def test_invalid_and_empty_specs_are_clear_errors_remembered(make_validator):
    validator = make_validator()
    with pytest.raises(ValueError, match="regex is invalid or unsupported"):
        validator.validate(StructuredOutputsParams(regex="a{3,1}"))
    with pytest.raises(ValueError, match="admits no output"):
        validator.validate(StructuredOutputsParams(regex="[^\\s\\S]"))
    for spec in (StructuredOutputsParams(regex="a{3,1}"), StructuredOutputsParams(choice=["a"])):
        validator.validate(StructuredOutputsParams(choice=["a"]))
        assert spec_key(spec) in validator._outcomes


def test_a_slow_compile_is_killed_at_its_deadline_and_refused_at_once_after(make_validator):
    validator = make_validator(timeout_s=0.5)
    spec = slow_grammar(1600)
    checkers = child_pids()  # the idle worker the check will run in, and the forkserver
    start = time.monotonic()
    with pytest.raises(ValueError, match="longer than 0.5 s"):
        validator.validate(spec)
    assert time.monotonic() - start < 1.5
    assert busy_children(checkers) == []  # the compile stopped with its process
    start = time.monotonic()
    with pytest.raises(ValueError, match="longer than"):
        validator.validate(spec)  # remembered: not compiled again
    assert time.monotonic() - start < 0.05


def test_slow_specs_on_every_slot_do_not_deny_the_next_request(make_validator):
    validator = make_validator(timeout_s=1.0, max_concurrent=4)
    errors = []

    def send(title: str) -> None:
        try:
            validator.validate(slow_grammar(1600, title))
        except ValueError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # all four slots now compile
    checkers = child_pids()
    start = time.monotonic()
    validator.validate(StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    assert time.monotonic() - start < 2.0
    for thread in threads:
        thread.join(5.0)
    assert len(errors) == 4 and all("longer than" in str(e) for e in errors)
    assert busy_children(checkers) == []


def test_a_cancelled_check_frees_its_slot_and_is_not_remembered(make_validator):
    validator = make_validator(timeout_s=10.0, max_concurrent=1)
    spec = slow_grammar(1600)
    cancelled = threading.Event()
    context = contextvars.copy_context()
    context.run(CHECK_CANCELLED.set, cancelled)
    raised = []

    def send() -> None:
        try:
            context.run(validator.validate, spec)
        except CheckCancelled as exc:
            raised.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    cancelled.set()
    thread.join(2.0)
    assert raised and time.monotonic() - start < 1.0
    assert spec_key(spec) not in validator._outcomes
    validator.validate(StructuredOutputsParams(choice=["x"]))  # the one slot is free again


def test_every_slot_busy_is_a_capacity_error(make_validator):
    validator = make_validator(timeout_s=0.3, max_concurrent=1)
    pool = validator._get_pool()
    pool._slots.acquire()  # the one slot, held as by a compile
    try:
        with pytest.raises(CompileCapacityError):
            validator.validate(StructuredOutputsParams(choice=["x"]))
    finally:
        pool._slots.release()
    validator.validate(StructuredOutputsParams(choice=["x"]))  # not remembered as refused


def test_concurrent_requests_with_one_spec_share_its_check(make_validator):
    validator = make_validator(timeout_s=10.0)
    pool = validator._get_pool()
    calls = []
    real_check = pool.check

    def counted(spec, *args):
        calls.append(spec)
        time.sleep(0.3)  # long enough for the others to find it running
        return real_check(spec, *args)

    pool.check = counted
    spec = StructuredOutputsParams(regex="[0-9]{3}")
    threads = [threading.Thread(target=validator.validate, args=(spec,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5.0)
    assert calls == [spec]


def test_optional_property_cost():
    assert optional_property_cost({"type": "string"}) == 0
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(5000)}}
    assert optional_property_cost(wide) == 5000**2
    nested = {
        "type": "object",
        "properties": {"a": wide, "b": {"type": "integer"}},
        "required": ["a", 7, {"x": 1}],  # odd entries count for nothing
    }
    assert optional_property_cost(nested) == 1 + 5000**2
    assert optional_property_cost([{"properties": {"x": {}}, "required": "x"}]) == 1
