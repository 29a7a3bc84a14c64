"""Property-based fuzzing of a real `tokenbus serve` from its own OpenAPI schema (schemathesis):
whatever the generated bodies hold, the server answers them, never with a 5xx (bounded: a fixed
number of examples per route, so that CI stays quick)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.fixtures.server import ServerProcess

EXAMPLES_PER_ROUTE = 100


@pytest.mark.slow
def test_no_generated_request_makes_the_server_fail(tiny_llama_dir, tmp_path):
    # --max-request-tokens: generated max_tokens stay cheap for the engine (a 400 above it).
    with ServerProcess(
        str(tiny_llama_dir),
        "--max-model-len",
        "256",
        "--max-request-tokens",
        "512",
        log_dir=tmp_path,
    ) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {
            "/v1/completions",
            "/v1/chat/completions",
            "/tokenize",
        }
        statuses: dict[str, set[int]] = {}
        for operation in operations:
            # The schemathesis pytest plugin does not load under this pytest: drive hypothesis
            # directly with each operation's strategy.
            @given(case=operation.as_strategy())
            @settings(
                max_examples=EXAMPLES_PER_ROUTE,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def check(case) -> None:
                response = case.call(base_url=server.url, timeout=60)
                statuses.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
                assert response.status_code < 500, (
                    case.path,
                    case.body,
                    response.status_code,
                    response.text[:500],
                )

            check()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert "Traceback" not in server.log()
        # The fuzzing reached the engine, not only the validators.
        assert (
            200 in statuses["POST /v1/completions"] and 400 in statuses["POST /v1/completions"]
        ), statuses
