"""``/openapi.json`` describes every route's body by its request model, and schemathesis fuzzes every
route over it against a real server: no 5xx, and no leaked block or lock afterwards."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from serve_helpers import Served, write_model_dir

POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("openapi") / "tiny-smol"
    write_model_dir(directory, max_positions=512, weights=True)
    server = Served(directory, max_output_tokens=4)  # every fuzzed generation stays short
    yield server
    server.stop()


def test_every_body_is_described_by_its_model(served):
    doc = httpx.get(served.base_url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    for path in POST_ROUTES:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        assert {"messages", "prompt", "input"} & set(schemas[name]["properties"])
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.add(node["$ref"].rsplit("/", 1)[1])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs <= set(schemas), f"dangling references: {refs - set(schemas)}"


def operations(served):
    schema = schemathesis.openapi.from_url(served.base_url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_server_error(served, mode):
    """Valid bodies (by the document) and invalid ones, on every route: never a 5xx."""
    ops = operations(served)
    assert {op.path for op in ops} >= set(POST_ROUTES)
    statuses = []
    for op in ops:
        if mode == GenerationMode.NEGATIVE and op.method.upper() in ("GET", "DELETE"):
            continue  # nothing to make invalid: no parameters, or only a path id (any string is one)
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def fuzz(case):
            response = case.call(base_url=served.base_url, timeout=60)
            statuses.append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error])

        fuzz()
    assert statuses and max(statuses) < 500


def test_the_cache_is_exact_after_fuzzing(served):
    served.assert_clean()
    assert served.state.gate.in_flight == 0
