"""The front-door grammar check: a compile that runs past its deadline is refused, not waited on."""

import pytest

from tokenbus.sampling_params import StructuredOutputsParams
from tokenbus.structured.validator import StructuredOutputValidator


class _SlowBackend:
    def compile(self, spec):
        import time

        time.sleep(0.5)


def test_compile_past_the_deadline_is_a_clear_error():
    validator = StructuredOutputValidator(tokenizer=None, vocab_size=10, timeout_s=0.05)
    validator._backend = _SlowBackend()  # stands in for a pathological regex
    with pytest.raises(ValueError, match="longer than"):
        validator.validate(StructuredOutputsParams(regex="(a|aa)*b"))


class _SelectiveBackend:
    """Slow for the one pathological spec, instant for the rest; counts compiles."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def compile(self, spec):
        import time

        self.calls.append(spec.regex)
        if spec.regex == "slow":
            time.sleep(1.0)
        if spec.regex == "bad":
            raise ValueError("structured_outputs: regex is invalid")


def test_overdue_compiles_do_not_starve_later_specs_and_outcomes_are_cached():
    import time

    validator = StructuredOutputValidator(
        tokenizer=None, vocab_size=10, timeout_s=0.1, max_concurrent=3
    )
    backend = validator._backend = _SelectiveBackend()
    for _ in range(2):  # two compiles overdue, each still holding a slot
        with pytest.raises(ValueError, match="longer than"):
            validator.validate(StructuredOutputsParams(regex="slow"))
        validator._outcomes.clear()  # forget, so that the second one compiles again
    start = time.monotonic()
    validator.validate(StructuredOutputsParams(regex="fast"))  # the free slot: no waiting
    assert time.monotonic() - start < 0.1
    with pytest.raises(ValueError, match="invalid"):
        validator.validate(StructuredOutputsParams(regex="bad"))
    calls = len(backend.calls)
    validator.validate(StructuredOutputsParams(regex="fast"))  # cached: not compiled again
    with pytest.raises(ValueError, match="invalid"):
        validator.validate(StructuredOutputsParams(regex="bad"))
    assert len(backend.calls) == calls


def test_every_slot_taken_by_slow_compiles_is_a_capacity_error():
    from tokenbus.structured.validator import CompileCapacityError

    validator = StructuredOutputValidator(
        tokenizer=None, vocab_size=10, timeout_s=0.1, max_concurrent=1
    )
    validator._backend = _SelectiveBackend()
    with pytest.raises(ValueError, match="longer than"):
        validator.validate(StructuredOutputsParams(regex="slow"))
    with pytest.raises(CompileCapacityError):
        validator.validate(StructuredOutputsParams(regex="fast"))


def test_concurrent_requests_with_one_spec_share_its_compile():
    import threading

    validator = StructuredOutputValidator(
        tokenizer=None, vocab_size=10, timeout_s=5.0, max_concurrent=4
    )
    backend = validator._backend = _SelectiveBackend()
    gate = threading.Event()
    real_compile = backend.compile

    def gated_compile(spec):
        gate.wait(5.0)
        return real_compile(spec)

    backend.compile = gated_compile
    threads = [
        threading.Thread(target=validator.validate, args=(StructuredOutputsParams(regex="same"),))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    import time

    time.sleep(0.2)
    gate.set()
    for thread in threads:
        thread.join(5.0)
    assert backend.calls == ["same"]


def test_a_compile_past_its_deadline_is_not_remembered_as_slow():
    import time

    validator = StructuredOutputValidator(
        tokenizer=None, vocab_size=10, timeout_s=0.3, max_concurrent=2
    )
    backend = validator._backend = _SelectiveBackend()
    with pytest.raises(ValueError, match="longer than"):
        validator.validate(StructuredOutputsParams(regex="slow"))  # takes 1 s
    time.sleep(1.0)  # it ends meanwhile; its outcome (it compiles) is what a retry gets
    validator.validate(StructuredOutputsParams(regex="slow"))
    assert backend.calls == ["slow"]
