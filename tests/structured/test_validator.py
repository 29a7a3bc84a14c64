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
