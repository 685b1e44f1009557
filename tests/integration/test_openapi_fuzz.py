"""A bounded schemathesis run against the live OpenAPI document (issue 9, item 5).

A real server on a real port, on SQLite and on MariaDB. Every operation of ``/openapi.json`` gets
cases that fit the schema (positive) and cases that break it (negative), half of them with real
ids (a namespace, queue, task, attempt, idempotency key, subscription and schedule made first),
sent with an admin key. Every response must:

- not be a server error (5xx);
- conform to the schema of its documented status (status, content type, body);
- carry ``X-Request-Id``;
- be ``application/problem+json`` when it is an error (4xx).

Generation is derandomised (the same cases every run), so a failure replays. The counts per
operation are written to the test's output (``-rP``) and asserted to cover every operation.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.servers import RunningServer

#: Cases per operation, over the four kinds (positive/negative x real/generated ids); more on demand
#: with ``ORBIT_FUZZ_CASES=2000``.
CASES_PER_OPERATION = int(os.environ.get("ORBIT_FUZZ_CASES", "40"))
KINDS = [
    (mode, real) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) for real in (True, False)
]


def _real_objects(server: RunningServer) -> tuple[dict[str, str], str]:
    """Make a namespace with a task, a running attempt, a subscription, a schedule and a flow instance;
    their ids."""
    namespace = f"fuzz-{uuid.uuid4().hex[:8]}"
    keys = server.add_namespace(namespace, ("default",))
    admin = keys["admin"]
    with httpx.Client(
        base_url=f"{server.base_url}/v1/namespaces/{namespace}",
        headers={"Authorization": f"Bearer {admin}"},
        timeout=30,
    ) as http:
        key = "fuzz-key-1"
        first = http.post(
            "/tasks", json={"queue": "default", "handler": "h"}, headers={"Idempotency-Key": key}
        )
        grant = http.post("/queues/default/leases", json={"worker_id": "fuzz"}).json()[0]
        attempt = grant["attempt"]
        http.post(f"/attempts/{attempt['id']}/start", json={"lease_token": attempt["lease_token"]})
        http.post(
            "/tasks", json={"queue": "default", "handler": "h"}, headers={"Idempotency-Key": "fuzz-key-2"}
        )
        assert http.post("/subscriptions", json={"name": "fuzz"}).status_code == 201
        schedule = {"name": "fuzz", "queue": "default", "handler": "h", "interval_seconds": 3600}
        assert http.post("/schedules", json=schedule).status_code == 201
        graph = {"start": "a", "nodes": {"a": {"type": "task", "queue": "default", "handler": "h", "next": "e"},
                                         "e": {"type": "end"}}}  # fmt: skip
        assert http.post("/flows/fuzz/versions", json={"graph": graph}).status_code == 201
        instance = http.post("/flows/fuzz/instances", json={"input": {}}, headers={"Idempotency-Key": key})
        assert instance.status_code == 201, instance.text
    ids = {
        "namespace": namespace,
        "queue": "default",
        "task_id": first.json()["id"],
        "attempt_id": attempt["id"],
        "idempotency_key": key,
        "name": "fuzz",
        "instance_id": instance.json()["id"],
        "version": "1",
    }
    return ids, admin


def test_every_operation_answers_within_its_schema(server: RunningServer) -> None:
    ids, admin = _real_objects(server)
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    counts: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    session = requests.Session()
    timings: dict[str, float] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 30
    for operation in operations:
        began = time.monotonic()
        names = {p.name for p in operation.path_parameters}
        for mode, real in KINDS:
            fixed = {name: ids[name] for name in names if name in ids and (real or name == "namespace")}
            strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed or None)

            @given(case=strategy)
            @settings(
                max_examples=CASES_PER_OPERATION // len(KINDS),
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any) -> None:
                body = case.body
                if isinstance(body, dict) and isinstance(body.get("wait_seconds"), int | float):
                    body["wait_seconds"] = 0  # a long poll answers after up to 60 s: not what this tests
                response = case.call(
                    headers={"Authorization": f"Bearer {admin}"}, session=session, timeout=30
                )
                counts[case.operation.label] += 1
                statuses[response.status_code] += 1
                problems = []
                try:
                    case.validate_response(response, checks=checks)
                except (
                    Exception,
                    BaseExceptionGroup,
                ) as exc:  # every failed check, with the case to replay it
                    problems.append(f"{type(exc).__name__}: {str(exc)[:600]}")
                headers = {name.lower(): values for name, values in response.headers.items()}
                if not headers.get("x-request-id"):
                    problems.append("no X-Request-Id")
                content_type = headers.get("content-type", [""])[0]
                if response.status_code >= 400 and content_type != "application/problem+json":
                    problems.append(f"an error as {content_type!r}")
                if problems:
                    failures.append(
                        f"{case.operation.label} {case.as_curl_command()}\n  " + "\n  ".join(problems)
                    )

            try:
                run()
            except Unsatisfiable:  # nothing to negate (no parameters, or all fixed)
                assert mode is GenerationMode.NEGATIVE, operation.label
        timings[operation.label] = time.monotonic() - began
    total = sum(counts.values())
    print(f"schemathesis: {len(counts)} operations, {total} cases; statuses {dict(sorted(statuses.items()))}")
    for label, count in sorted(counts.items()):
        print(f"  {count:5d} {timings[label]:5.1f}s {label}")
    assert len(counts) == len(operations)
    if failures:
        print("\n".join(failures[:50]))
    assert not failures, f"{len(failures)} failing cases of {total}:\n" + "\n".join(failures[:20])


# schemathesis draws from `random` inside its strategies; Hypothesis warns about it (not our code).
pytestmark = [
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
    # 90 s per database: part of `make test`, not of `make test-quick`.
    pytest.mark.slow,
]
