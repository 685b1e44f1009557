"""Every example of the served OpenAPI document is valid against the schema it illustrates, and the model
behind that schema reads it (issue 29, item 5): a client author who copies an example sends a body the server
accepts, and reads an answer shaped as the server sends it. So an example cannot drift from its model.

Each example is checked twice: with ``jsonschema`` (Draft 2020-12, formats checked: ``date-time`` too)
against its schema in the document, references resolved in the document; and by parsing it as JSON with the
``orbit_client`` model the schema was made from (the models the server validates with, including the rules
JSON Schema cannot say: ``ScheduleCreate``'s one trigger, ``ReviewRequest``'s result only on success). An
answer's example is also written back by its model unchanged: its times, numbers and fields are exactly
those the server would send.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from jsonschema import Draft202012Validator, FormatChecker
from pydantic import TypeAdapter
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

import orbit_client
from orbit_server.api.openapi_examples import RESPONSE_EXAMPLES

BASE = "urn:orbit:openapi"


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from orbit_server import ServerSettings, create_app

    where = tmp_path_factory.mktemp("examples")
    app = create_app(ServerSettings(database_url=f"sqlite:///{where}/orbit.db"))
    served: dict[str, Any] = json.loads(json.dumps(app.openapi()))  # through JSON, as clients read it
    return served


def _pointer(parts: tuple[str, ...]) -> str:
    return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def _at(document: dict[str, Any], parts: tuple[str, ...]) -> Any:
    node: Any = document
    for part in parts:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _examples(document: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...], Any]]:
    """``(where, path of the schema, value)`` of every example: a schema's ``examples`` (a list), and a
    media type's or parameter's ``example``/``examples`` (a map of Example Objects; a ``$ref`` to
    ``components.examples`` resolved, and those checked where they are used)."""

    def walk(node: Any, parts: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...], Any]]:
        if parts == ("components", "examples"):
            return
        if isinstance(node, dict):
            examples = node.get("examples")
            if isinstance(examples, list) and parts[-1:] != ("properties",):
                for i, value in enumerate(examples):
                    yield f"{_pointer(parts)}/examples/{i}", parts, value
            elif isinstance(examples, dict) and "schema" in node:
                for name, example in examples.items():
                    if "$ref" in example:
                        example = _at(document, tuple(example["$ref"].removeprefix("#/").split("/")))
                    yield f"{_pointer(parts)}/examples/{name}", (*parts, "schema"), example["value"]
            if "example" in node and "schema" in node:
                yield f"{_pointer(parts)}/example", (*parts, "schema"), node["example"]
            for key, value in node.items():
                if key not in ("examples", "example") or parts[-1:] == ("properties",):
                    yield from walk(value, (*parts, key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, (*parts, str(i)))

    yield from walk(document, ())


def _model(schema: dict[str, Any]) -> Any:
    """The ``orbit_client`` model a schema was made from (``X`` and ``XInput`` are the model ``X``), or
    a list of it."""
    if schema.get("type") == "array":
        return list[_model(schema["items"])]  # type: ignore[misc]
    name = schema["$ref"].removeprefix("#/components/schemas/")
    model = getattr(orbit_client, name.removesuffix("Input"), None)
    assert model is not None, f"no orbit_client model for the schema {name}"
    return model


def test_the_document_has_examples_where_a_client_author_looks(document: dict[str, Any]) -> None:
    bodies = {
        operation["operationId"]
        for operations in document["paths"].values()
        for operation in operations.values()
        if operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("examples")
    }
    assert {
        "submit_task", "submit_tasks", "lease_tasks", "start_attempt", "heartbeat_attempt", "complete_attempt",
        "fail_attempt", "start_attempts", "heartbeat_attempts", "complete_attempts", "fail_attempts",
        "cancel_task", "retry_task", "review_task", "create_schedule", "create_subscription", "start_flow",
        "signal_flow",
    } <= bodies  # fmt: skip
    answers = {
        (operation["operationId"], status)
        for operations in document["paths"].values()
        for operation in operations.values()
        for status, response in operation["responses"].items()
        if response.get("content", {}).get("application/json", {}).get("examples")
    }
    assert set(RESPONSE_EXAMPLES) <= answers  # none lost to a renamed operation or status
    schemas = document["components"]["schemas"]
    for name in ("Task", "LeaseGrant", "AttemptState", "AttemptBatchResponse", "Delivery"):
        assert schemas[name].get("examples"), name
    codes = {
        example["value"]["code"]
        for operations in document["paths"].values()
        for operation in operations.values()
        for response in operation["responses"].values()
        for example in response.get("content", {})
        .get("application/problem+json", {})
        .get("examples", {})
        .values()
    }
    assert {"idempotency_key_reused", "lease_lost", "validation_error"} <= codes
    submit = document["paths"]["/v1/namespaces/{namespace}/tasks"]["post"]
    assert set(submit["responses"]["422"]["content"]["application/problem+json"]["examples"]) == codes - {
        "lease_lost"
    }
    # Report-and-lease: a complete batch carrying a lease request, answered with its grants.
    complete = document["paths"]["/v1/namespaces/{namespace}/attempts/complete"]["post"]
    assert any(
        "lease" in e["value"]
        for e in complete["requestBody"]["content"]["application/json"]["examples"].values()
    )
    answers = complete["responses"]["200"]["content"]["application/json"]["examples"]
    assert any(e["value"].get("grants") for e in answers.values())


def test_every_example_is_valid_against_its_schema_and_read_by_its_model(document: dict[str, Any]) -> None:
    registry: Registry[Any] = Registry().with_resource(
        BASE, Resource.from_contents(document, default_specification=DRAFT202012)
    )
    bodies = {
        operation["requestBody"]["content"]["application/json"]["schema"].get("$ref")
        for operations in document["paths"].values()
        for operation in operations.values()
        if "requestBody" in operation
    }
    formats = FormatChecker()
    assert "date-time" in formats.checkers, (
        "jsonschema checks date-time only with rfc3339-validator installed"
    )
    checked = 0
    failures: list[str] = []
    for where, schema_path, value in _examples(document):
        checked += 1
        validator = Draft202012Validator(
            {"$ref": f"{BASE}#{_pointer(schema_path)}"}, registry=registry, format_checker=formats
        )
        failures += [f"{where}: {error.json_path}: {error.message}" for error in validator.iter_errors(value)]
        if schema_path[:2] == ("components", "schemas"):
            schema = {"$ref": "#/components/schemas/" + schema_path[2]}
            answer = schema["$ref"] not in bodies
        else:
            schema = _at(document, schema_path)
            answer = "responses" in schema_path
        adapter: TypeAdapter[Any] = TypeAdapter(_model(schema))
        try:
            parsed = adapter.validate_json(json.dumps(value))
        except ValueError as error:
            failures.append(f"{where}: the model refuses it: {error}")
            continue
        written = adapter.dump_python(parsed, mode="json", exclude_unset=True)
        if answer and written != value:
            failures.append(f"{where}: the model writes it otherwise: {json.dumps(written)}")
    assert not failures, "\n".join(failures)
    assert checked >= 40, checked
