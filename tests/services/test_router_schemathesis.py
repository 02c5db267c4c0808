"""schemathesis over the router's own ``/openapi.json``: every operation, bodies generated from the
request models, against the ASGI app over a scripted backend: valid bodies from the schema with
their sizes bounded, and schema-breaking bodies from the real schema (which must be refused).
No answer may be a server error (5xx); answers must match what the schema says of them (statuses,
content types, headers, bodies), and a body the schema forbids must be refused. Valid bodies' sizes
are bounded (token counts, ``n``, string lengths, list lengths) so the run fits CI; they name the served model, so they get past the 404 into the serving layer; examples
are derandomized, so a failure reproduces."""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from router_fixtures import MODEL_DIR, ScriptedBackend
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer

# 20-50 s on this machine (2 cores, shared): over the quick subset's ~30 s a test
pytestmark = pytest.mark.slow

MODEL = "glm52-tiny"
EXAMPLES = int(os.environ.get("GLMSERVE_SCHEMATHESIS_EXAMPLES", "15"))  # per operation
# Numbers that size the work a request asks for, bounded so every example is cheap.
BOUNDS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "logprobs": 3, "top_logprobs": 3,
          "priority": 10}
MAX_STRING, MAX_ITEMS = 48, 3


def bounded_requests(schema: dict[str, Any]) -> dict[str, Any]:
    """The API schema with what requests carry bounded (answers are left as documented)."""
    out = {**schema, "paths": {}, "components": {**schema["components"], "schemas": {}}}
    for name, body in schema["components"]["schemas"].items():
        out["components"]["schemas"][name] = body if name == "ErrorResponse" else bounded(body)
    for path, operations in schema["paths"].items():
        out["paths"][path] = {method: {**op, **{k: bounded(v) for k, v in op.items() if k != "responses"}}
                              for method, op in operations.items()}
    return out


def bounded(node: Any) -> Any:
    """``node`` with every string, list and work-sizing number given a small upper bound."""
    if isinstance(node, list):
        return [bounded(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded(v) for k, v in node.items()}
    if out.get("type") == "string" and "enum" not in out:
        out["maxLength"] = min(out.get("maxLength", MAX_STRING), MAX_STRING)
    if out.get("type") == "array":
        out["maxItems"] = min(out.get("maxItems", MAX_ITEMS), MAX_ITEMS)
    for name, limit in BOUNDS.items():
        prop = out.get("properties", {}).get(name)
        if isinstance(prop, dict):
            out["properties"][name] = _capped(prop, limit)
    if isinstance(out.get("properties", {}).get("model"), dict):  # the served one: past the 404
        out["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    return out


def _capped(prop: dict[str, Any], limit: int) -> dict[str, Any]:
    if prop.get("type") in ("integer", "number"):
        return {**prop, "maximum": min(prop.get("maximum", limit), limit)}
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return {**prop, key: [_capped(p, limit) for p in prop[key]]}
    return prop


def _app(bounded_bodies: bool):
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    backend = ScriptedBackend(lambda _: tokenizer.encode(" hello world"), tokenizer)
    app = create_app(backend, tokenizer, MODEL, max_context=256)
    if bounded_bodies:
        app.openapi_schema = bounded_requests(app.openapi())  # what /openapi.json serves from now on
    return app


@pytest.fixture(scope="module")
def valid_bodies():
    """Bodies the (bounded) schema allows."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", _app(bounded_bodies=True))
    schema.config.generation.update(modes=[GenerationMode.POSITIVE])
    return schema


@pytest.fixture(scope="module")
def invalid_bodies():
    """Bodies the real schema forbids (each breaks one of its rules)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", _app(bounded_bodies=False))
    schema.config.generation.update(modes=[GenerationMode.NEGATIVE])
    return schema


SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
valid = schemathesis.pytest.from_fixture("valid_bodies")
invalid = schemathesis.pytest.from_fixture("invalid_bodies").include(method="POST")  # routes with a body


@valid.parametrize()
@SETTINGS
def test_valid_bodies_get_no_server_error_and_answers_as_documented(case):
    # Every other check runs (no 5xx, documented statuses, content types, headers and bodies). A
    # body the schema allows may still get a 400: the router checks more than a schema can say (the
    # model's name, content a role needs, a prompt that fits the context...).
    case.call_and_validate(excluded_checks=[positive_data_acceptance])


@invalid.parametrize()
@SETTINGS
def test_invalid_bodies_are_refused_with_documented_4xx(case):
    case.call_and_validate(excluded_checks=[positive_data_acceptance])


def test_valid_bodies_reached_the_backend(valid_bodies):
    """The run above got past validation into generation (it would prove little otherwise)."""
    generated = valid_bodies.app.state.backend.generated
    assert len(generated) >= 5, len(generated)
