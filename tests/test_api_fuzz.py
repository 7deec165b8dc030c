"""Property-based fuzzing of the HTTP API with schemathesis, against our own /openapi.json and a
real `roseinfer serve`: for every route, requests that fit the document and requests that break
it. Checks: no 5xx, every status and content type documented, every JSON body (errors included)
matching its documented schema, documented headers present.

Bounded: EXAMPLES generated requests per route plus schemathesis' boundary cases, a seed fixed for
repeatability, and every request's generation kept to a few tokens before it is sent.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from live_server import ServerProcess
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = 12
MAX_NEW_TOKENS = 3
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
# The fields that bound each route's generation (a missing or null one means long: the context).
# Routes that generate nothing (/v1/embeddings: prefill only; /tokenize) need none.
LENGTH_FIELDS = {"/v1/completions": ("max_tokens",), "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                 "/generate": ("max_new_tokens",), "/v1/messages": ("max_tokens",),
                 "/v1/responses": ("max_output_tokens",), "/api/chat": ("options.num_predict",),
                 "/api/generate": ("options.num_predict",)}


CASES: Counter[str] = Counter()  # requests sent per route, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    process = ServerProcess("--request-timeout", "120")  # a generation that escaped the bound still ends
    yield process
    print(f"schemathesis sent {sum(CASES.values())} requests: {dict(CASES)}")
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess):
    config = schemathesis.Config.from_dict({"seed": 20260523, "generation": {"max-examples": EXAMPLES}})
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")
if os.environ.get("FUZZ_PATH_REGEX"):  # e.g. "^/v1/messages|tokenize": fuzz only the routes it matches
    schema = schema.include(path_regex=os.environ["FUZZ_PATH_REGEX"])


@pytest.fixture(autouse=True)
def _pytest9_node_id(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32 reads pytest's private `Node._nodeid`, which pytest 9 no longer has."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def bound_generation(case: schemathesis.Case) -> None:
    """Keep generation short: a length that is missing, null or above MAX_NEW_TOKENS (as a number
    or a numeric string, which pydantic accepts) becomes MAX_NEW_TOKENS; an invalid one, such as 0
    or "abc", stays as drawn: it must be refused. Done on each case before it is sent, whatever
    phase drew it."""
    if isinstance(case.body, dict):
        for field in LENGTH_FIELDS.get(case.operation.path, ()):
            body, *outer = case.body, *field.split(".")[:-1]
            for name in outer:  # a nested field (Ollama's options.num_predict): its object made if missing
                if body.get(name) is None:
                    body[name] = {}
                body = body[name]
            if not isinstance(body, dict):
                continue  # an invalid object: it must be refused
            field = field.split(".")[-1]
            value = body.get(field)
            number = _as_number(value)
            if value is None or (number is not None and number > MAX_NEW_TOKENS) or number in (-1, -2):
                body[field] = MAX_NEW_TOKENS


def _as_number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_answers_every_request_as_documented(case: schemathesis.Case) -> None:
    bound_generation(case)
    CASES[case.operation.label] += 1
    case.call_and_validate(checks=CHECKS, timeout=120)
