"""Finishing touches of the OpenAPI document that FastAPI cannot derive from the routes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from orbit_client import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
)

#: The ``Idempotency-Key`` rule of :func:`orbit_client.is_valid_idempotency_key` as a JSON Schema pattern.
_IDEMPOTENCY_KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": IDEMPOTENCY_KEY_MAX_LENGTH,
    "pattern": r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$",
}


def _finish_openapi(app: FastAPI) -> None:
    """Mark ``Idempotency-Key`` required in the OpenAPI document, with its pattern; document the
    problem answers every operation with a body may give.

    The route takes the key as optional so that a missing or malformed key is answered with the
    documented ``400 idempotency_key_missing``/``idempotency_key_invalid``, not a 422. A body may
    be refused before any route runs: ``400`` unreadable (``invalid_utf8``, ``integer_too_long``,
    ``nesting_too_deep``), ``408 request_timeout``, ``413 payload_too_large``, ``422``.
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
                    for status in ("400", "408", "413", "422"):
                        operation["responses"].setdefault(status, problem)
                for parameter in operation.get("parameters", []):
                    if parameter.get("in") == "header" and parameter.get("name") == "Idempotency-Key":
                        parameter["required"] = True
                        parameter["schema"] = dict(_IDEMPOTENCY_KEY_SCHEMA, title="Idempotency-Key")
                        parameter["description"] = (
                            "1-255 printable ASCII characters, no leading or trailing space; unique per "
                            'task (README "HTTP API").'
                        )
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
