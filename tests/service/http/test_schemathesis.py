"""Property-based requests from the live OpenAPI schema (schemathesis): no 5xx, and every answer
conforms to the documented schema. Bounded: a few dozen examples per operation."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from loadtest.localserver import start_server, stop_server

TOKEN = "schemathesis-token"
EXAMPLES_PER_OPERATION = 40
# Reload and promote change what the server serves; their refusals are tested in test_admin_ab_shadow.
SKIPPED = ("POST /admin/reload", "POST /admin/promote")


@pytest.fixture(scope="module")
def live_schema(tiny_rae_bundle, tmp_path_factory):
    env = {"XMCSERVE_ADMIN_TOKEN": TOKEN, "XMCSERVE_BUNDLE_ROOT": str(tiny_rae_bundle.parent)}
    server = start_server(tiny_rae_bundle, tmp_path_factory.mktemp("logs") / "schemathesis.log", extra_env=env)
    yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    stop_server(server)


def test_no_server_errors_and_answers_match_the_schema(live_schema):
    operations = [result.ok() for result in live_schema.get_all_operations()]
    checked, calls = [], []
    for operation in operations:
        if operation.label in SKIPPED:
            continue

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case):
            response = case.call(timeout=60)
            calls.append(response.status_code)
            # a deadline the caller set itself (timeout_ms: 1) that the queue could not meet is a 503
            # by design; on a loaded machine it happened, on an idle one it did not. Its body is still
            # checked against the schema; every other 5xx is a failure
            asked = isinstance(case.body, dict) and case.body.get("timeout_ms") is not None
            missed = response.status_code == 503 and asked and "within its deadline" in response.text
            checks = [response_schema_conformance] if missed else [not_a_server_error, response_schema_conformance]
            case.validate_response(response, checks=checks)

        check()
        checked.append(operation.label)
    assert "POST /predict" in checked and len(checked) >= 6, checked
    assert len(calls) >= 3 * len(checked) and 200 in calls and 422 in calls, calls
