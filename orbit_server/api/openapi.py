"""Finishing touches of the OpenAPI document that FastAPI cannot derive from the routes."""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from orbit_client import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
)
from orbit_server.api.openapi_examples import (
    PROBLEM_EXAMPLES,
    REQUEST_EXAMPLES,
    RESPONSE_EXAMPLES,
    SCHEMA_EXAMPLES,
)

#: The ``Idempotency-Key`` rule of :func:`orbit_client.is_valid_idempotency_key` as a JSON Schema pattern.
_IDEMPOTENCY_KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": IDEMPOTENCY_KEY_MAX_LENGTH,
    "pattern": r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$",
}


#: operationIds where the route function's name alone would be vague in a generated client: the names
#: of ``OrbitClient``'s methods where it has one.
_OPERATION_IDS = {
    "cancel_instance": "cancel_flow_instance",
    "pause_instance": "pause_flow_instance",
    "resume_instance": "resume_flow_instance",
    "get_instance": "get_flow_instance",
    "list_instances": "list_flow_instances",
    "start_instance": "start_flow",
    "get_history": "get_flow_history",
    "list_versions": "list_flow_versions",
    "get_version": "get_flow_version",
    "publish_version": "publish_flow",
    "send_signal": "signal_flow",
    "heartbeat": "heartbeat_attempt",
    "heartbeats": "heartbeat_attempts",
    "published_settings": "get_settings",
    "prometheus_metrics": "get_metrics",
    "list_attempts": "list_task_attempts",
    "list_events": "list_task_events",
}

#: Declared tags, in the order the document's readers (Swagger UI, ReDoc, generators) show them.
_TAGS = [
    {
        "name": "tasks",
        "description": "Submit tasks (idempotent by `Idempotency-Key`), read, cancel, review, retry.",
    },
    {"name": "execution", "description": "The worker protocol: lease, start, heartbeat, complete, fail."},
    {"name": "results", "description": "Subscriptions to result events, their deliveries and acks."},
    {"name": "queues", "description": "Queues: limits, pause and resume."},
    {"name": "schedules", "description": "Cron and interval schedules and their occurrences."},
    {"name": "flows", "description": "Flow versions, instances, signals and control."},
    {"name": "operations", "description": "Health, readiness, metrics and the published settings."},
]

#: Response headers, by where they are sent.
_REQUEST_ID = {
    "description": "The request's id: the caller's `X-Request-Id` when well-formed, else a new one; in the log.",
    "schema": {"type": "string"},
}
_RETRY_AFTER = {
    "description": "Seconds to wait before trying again.",
    "schema": {"type": "integer", "format": "int64"},
}
_REPLAYED = {
    "description": "`true` when the answer is the original result of an earlier request with this key.",
    "schema": {"type": "string", "enum": ["true"]},
}
_LOCATION = {"description": "The URL path of the resource.", "schema": {"type": "string"}}

_TIME_NAMES = ("deadline",)
#: Response properties the server leaves out at times: a batch of attempt reports carries ``grants`` and
#: ``lease_error`` only when it carried a lease request (report-and-lease).
_SOMETIMES_SENT = {
    "AttemptBatchResponse": {"grants", "lease_error"},
    # A flow step's priority is left out when unset, so that older clients still read the graph.
    "TaskNode": {"priority"},
    "PollNode": {"priority"},
}
#: The operations whose 201 names the new resource in ``Location``.
_SENDS_LOCATION = {"submit_task", "retry_task", "create_subscription", "start_flow"}
#: The attempt calls whose 409 is most often ``lease_lost``.
_LOSES_LEASE = {"start_attempt", "heartbeat_attempt", "complete_attempt", "fail_attempt"}


def operation_id(route: APIRoute) -> str:
    """A route's ``operationId``: its function's name (``submit_task``), or the client's name for it,
    short and stable for clients generated from the document; a test keeps them unique."""
    return _OPERATION_IDS.get(route.name, route.name)


def _walk(node: Any) -> Any:
    """Every dict inside ``node`` (``node`` too), depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _refs(node: Any) -> set[str]:
    return {d["$ref"].rsplit("/", 1)[1] for d in _walk(node) if isinstance(d.get("$ref"), str)}


def _closure(names: set[str], schemas: dict[str, Any]) -> set[str]:
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen or name not in schemas:
            continue
        seen.add(name)
        todo.extend(_refs(schemas[name]))
    return seen


def _rename_schemas(schema: dict[str, Any]) -> None:
    """FastAPI's ``X-Input``/``X-Output`` pairs share one title, so some generators keep only one class:
    the output is ``X`` and the input ``XInput``, each titled by its name."""
    schemas = schema.get("components", {}).get("schemas", {})
    renames = {}
    for name in list(schemas):
        if name.endswith("-Output"):
            renames[name] = name.removesuffix("-Output")
        elif name.endswith("-Input"):
            renames[name] = name.removesuffix("-Input") + "Input"
    for old, new in renames.items():
        assert new not in schemas, new
        schemas[new] = schemas.pop(old)
        schemas[new]["title"] = new
    # A schema that is only a reference to another (``ChoiceRule`` → ``ChoiceRuleDump``) is that other one:
    # generators would make two models of one name.
    for name, body in list(schemas.items()):
        if set(body) <= {"$ref", "title", "description"} and "$ref" in body:
            renames[name] = body["$ref"].rsplit("/", 1)[1]
            del schemas[name]
    for old, new in list(renames.items()):
        while new in renames and renames[new] != new:
            new = renames[new]
        renames[old] = new
    for node in _walk(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.rsplit("/", 1)[1] in renames:
            node["$ref"] = "#/components/schemas/" + renames[ref.rsplit("/", 1)[1]]
        discriminator = node.get("discriminator")
        if isinstance(discriminator, dict):
            mapping = discriminator.get("mapping", {})
            for key, target in mapping.items():
                if target.rsplit("/", 1)[1] in renames:
                    mapping[key] = "#/components/schemas/" + renames[target.rsplit("/", 1)[1]]
            # The tag is required in every variant (the server cannot tell the variant without it), so
            # the variants are mutually exclusive for generators and linters.
            for target in mapping.values():
                variant = schemas.get(target.rsplit("/", 1)[1], {})
                required = variant.setdefault("required", [])
                if discriminator["propertyName"] not in required:
                    required.append(discriminator["propertyName"])


def _formats(schema: dict[str, Any]) -> None:
    """``format: int64`` on every integer (ids, counts and flow versions may pass 2^31 - 1), ``format:
    date-time`` on every time (RFC 3339: the properties named ``*_at`` and ``deadline``)."""
    for node in _walk(schema):
        if node.get("type") == "integer":
            node.setdefault("format", "int64")
        for name, prop in (node.get("properties") or {}).items():
            if not isinstance(prop, dict) or not (name.endswith("_at") or name in _TIME_NAMES):
                continue
            for branch in [prop, *prop.get("anyOf", [])]:
                if branch.get("type") == "string" and "format" not in branch and "enum" not in branch:
                    branch["format"] = "date-time"


def _outputs_required(schema: dict[str, Any]) -> None:
    """Every property of a schema only ever sent by the server is required: the server always sends
    each field (``null`` when empty), so clients need not treat it as optional."""
    schemas = schema.get("components", {}).get("schemas", {})
    inputs: set[str] = set()
    outputs: set[str] = set()
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            inputs |= _refs(operation.get("requestBody", {})) | _refs(operation.get("parameters", []))
            outputs |= _refs(operation.get("responses", {}))
    inputs, outputs = _closure(inputs, schemas), _closure(outputs, schemas)
    for name in outputs - inputs:
        if name in ("Problem", "JsonValue") or "properties" not in schemas[name]:
            continue  # a problem's members beyond code/title/status depend on the problem
        sent = set(schemas[name]["properties"]) - _SOMETIMES_SENT.get(name, set())
        schemas[name]["required"] = sorted(sent)


def _problems_and_headers(schema: dict[str, Any]) -> None:
    """Error answers are ``application/problem+json`` with the ``Problem`` schema (FastAPI put the schema
    under ``application/json``, which the server never sends for an error); every answer may be
    ``503 database_unavailable``; the headers the server sends are described."""
    problem_ref = {"$ref": "#/components/schemas/Problem"}
    unavailable = {
        "description": "Service Unavailable: the database cannot be used; nothing was done (`database_unavailable`)",
        "headers": {"Retry-After": _RETRY_AFTER, "X-Request-Id": _REQUEST_ID},
        "content": {"application/problem+json": {"schema": problem_ref}},
    }
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if path not in ("/healthz", "/metrics"):  # neither asks the database
                responses.setdefault("503", unavailable)
            for status, response in responses.items():
                content = response.get("content", {})
                if status.isdigit() and int(status) >= 400:
                    content.pop("application/json", None)
                    content["application/problem+json"] = {"schema": problem_ref}
                    response["content"] = content
                headers = response.setdefault("headers", {})
                headers.setdefault("X-Request-Id", _REQUEST_ID)
                if status in ("409", "429", "503"):
                    headers.setdefault("Retry-After", _RETRY_AFTER)
                if status == "200" and any(
                    p.get("name") == "Idempotency-Key" for p in operation.get("parameters", [])
                ):
                    headers.setdefault("Idempotent-Replayed", _REPLAYED)
                if status == "201" and operation.get("operationId") in _SENDS_LOCATION:
                    headers.setdefault("Location", _LOCATION)
            if path in ("/healthz", "/readyz", "/metrics"):
                operation["security"] = []


def _problem_codes(operation: dict[str, Any], status: str) -> list[str]:
    """The codes of :data:`PROBLEM_EXAMPLES` shown as examples of one error answer of ``operation``."""
    if status == "422" and "requestBody" in operation:
        reused = ["idempotency_key_reused"] if operation.get("operationId") == "submit_task" else []
        return [*reused, "validation_error"]
    if status == "409" and operation.get("operationId") in _LOSES_LEASE:
        return ["lease_lost"]
    return []


def _examples(schema: dict[str, Any]) -> None:
    """Named examples (:mod:`orbit_server.api.openapi_examples`) on the request bodies and the main
    answers, the common problems on the error answers that give them, and JSON Schema ``examples`` on
    the main schemas and on every request body's schema (its first named example; openapi-typescript
    writes them as ``@example``). The problems are written out, not ``$ref``'d to ``components.examples``:
    the docs site's renderer shows a referenced Example Object whole, summary and all. Copied in, so that
    changing the served document cannot change them; new answer and media objects, because FastAPI and
    :func:`_finish_openapi` share some between operations."""
    schemas = schema.get("components", {}).get("schemas", {})
    for name, values in SCHEMA_EXAMPLES.items():
        schemas[name]["examples"] = copy.deepcopy(values)
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            name = operation.get("operationId")
            if name in REQUEST_EXAMPLES:
                body = operation["requestBody"]
                media = body["content"]["application/json"]
                named = copy.deepcopy(REQUEST_EXAMPLES[name])
                operation["requestBody"] = {
                    **body,
                    "content": {**body["content"], "application/json": {**media, "examples": named}},
                }
                ref = media["schema"].get("$ref", "")
                if ref.startswith("#/components/schemas/"):
                    target = schemas[ref.rsplit("/", 1)[1]]
                    target.setdefault("examples", [copy.deepcopy(next(iter(named.values()))["value"])])
            responses = operation.get("responses", {})
            for status, response in list(responses.items()):
                content = dict(response.get("content", {}))
                if (name, status) in RESPONSE_EXAMPLES:
                    named = copy.deepcopy(RESPONSE_EXAMPLES[(name, status)])
                    content["application/json"] = {**content["application/json"], "examples": named}
                codes = _problem_codes(operation, status)
                if codes:
                    problems = {code: copy.deepcopy(PROBLEM_EXAMPLES[code]) for code in codes}
                    content["application/problem+json"] = {
                        **content["application/problem+json"],
                        "examples": problems,
                    }
                if content != response.get("content", {}):
                    responses[status] = {**response, "content": content}


def _finish_openapi(app: FastAPI) -> None:
    """Mark ``Idempotency-Key`` required in the OpenAPI document, with its pattern; document the
    problem answers every operation with a body may give.

    The route takes the key as optional so that a missing or malformed key is answered with the
    documented ``400 idempotency_key_missing``/``idempotency_key_invalid``, not a 422. A body may
    be refused before any route runs: ``400`` unreadable (``invalid_json`` with line and column,
    ``invalid_utf8``, ``integer_too_long``, ``nesting_too_deep``), ``408 request_timeout``, ``413
    payload_too_large``, ``415 unsupported_media_type`` (no ``Content-Type: application/json``), ``422``.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        problem = {
            "description": "A problem (RFC 9457)",
            "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                if "requestBody" in operation:
                    for status in ("400", "408", "413", "415", "422"):
                        operation["responses"].setdefault(status, problem)
                for parameter in operation.get("parameters", []):
                    if parameter.get("in") == "header" and parameter.get("name") == "Idempotency-Key":
                        parameter["required"] = True
                        parameter["schema"] = dict(_IDEMPOTENCY_KEY_SCHEMA, title="Idempotency-Key")
                        parameter["description"] = (
                            "1-255 printable ASCII characters, no leading or trailing space; unique per "
                            'task (README "HTTP API").'
                        )
        _rename_schemas(schema)
        _formats(schema)
        _outputs_required(schema)
        _problems_and_headers(schema)
        _examples(schema)
        schema["tags"] = _TAGS
        schema["servers"] = [{"url": "/", "description": "The server that serves this document"}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
