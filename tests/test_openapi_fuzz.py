"""One request never takes the server down: a bounded schemathesis run over every operation of /openapi.json.

The real server (MiniLM on CPU) is fuzzed with bodies built from the spec's request schemas, valid and invalid
(negative mode). Every answer
must be below 500, an error must be JSON, and the server must still be healthy and serving afterwards.
Bounded and derandomized, so CI runs the same cases every time in well under a minute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.test_server import serve
from wde import Engine

MAX_EXAMPLES = 40  # per operation and generation mode; the whole file stays well under a minute on 2 CPU cores


@pytest.fixture(scope="module")
def base_url(minilm_path: Path) -> Iterator[str]:
    with Engine.from_workflow("bert", minilm_path) as engine, serve(engine, max_client_batch_size=64) as (url, _):
        yield url


@pytest.fixture(scope="module")
def api_schema(base_url: str):
    spec = httpx.get(f"{base_url}/openapi.json")
    assert spec.status_code == 200, spec.text
    posts = [path for path, ops in spec.json()["paths"].items() if "post" in ops]
    assert posts and all("requestBody" in spec.json()["paths"][p]["post"] for p in posts), \
        "every POST route documents its JSON body (openapi_extra=body_schema(...))"
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_request_is_a_server_error(api_schema, mode: GenerationMode) -> None:
    """Every operation, bodies valid (positive) or not (negative) by its schema. Driven by hypothesis directly
    rather than schemathesis' pytest plugin, which follows pytest's internals too closely to survive its updates."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    if mode is GenerationMode.NEGATIVE:  # only a request body can be invalid: the GET routes take no input
        operations = [op for op in operations if op.method.upper() == "POST"]

    for operation in operations:
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case) -> None:
            response = case.call(timeout=300)
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400:
                kind = ",".join(response.headers.get("content-type", []))  # schemathesis keeps lists of values
                assert kind.startswith("application/json"), (
                    f"{case.method} {case.formatted_path} answered {response.status_code} with {kind!r}, not"
                    f" JSON: {response.text[:500]!r}\nrequest body: {case.body!r}")
                response.json()  # and it parses

        check()


def test_server_still_serves_after_fuzzing(base_url: str) -> None:
    """Runs after the fuzz test (file order): nothing it sent broke the engine or the event loop."""
    assert httpx.get(f"{base_url}/health", timeout=300).status_code == 200
    r = httpx.post(f"{base_url}/v1/embeddings", json={"input": "hello"}, timeout=300)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 384
