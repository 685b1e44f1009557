"""The worker protocol through a client generated from Orbit's served OpenAPI document
(openapi-python-client): submit, replay, lease, start, complete, and read an error body's ``code``.

tests/integration/test_openapi_clients.py generates the client as the package ``orbit_generated`` beside
this file, type-checks this script with ``mypy --strict`` and runs it against a live server.
"""

from __future__ import annotations

import sys

from orbit_generated import AuthenticatedClient
from orbit_generated.api.execution import complete_attempt, lease_tasks, start_attempt
from orbit_generated.api.tasks import submit_task
from orbit_generated.models import (
    CompleteRequest,
    LeaseRequest,
    LeaseTokenRequest,
    Problem,
    TaskSubmission,
)


def protocol(base_url: str, api_key: str) -> list[str]:
    seen: list[str] = []
    params = {"order_id": 42}  # any JSON value
    with AuthenticatedClient(base_url=base_url, token=api_key) as client:
        body = TaskSubmission(queue="fulfilment", handler="orders.fulfil", params=params)
        first = submit_task.sync_detailed("shop", client=client, body=body, idempotency_key="order-42")
        if isinstance(first.parsed, Problem):
            return [first.parsed.code]
        assert first.parsed is not None
        seen.append(f"{first.status_code} {first.parsed.status}")
        again = submit_task.sync_detailed("shop", client=client, body=body, idempotency_key="order-42")
        seen.append(f"replayed: {again.headers.get('Idempotent-Replayed', 'no')}")

        grants = lease_tasks.sync(
            "shop", "fulfilment", client=client, body=LeaseRequest(worker_id="py-worker", max_tasks=1)
        )
        for grant in grants if isinstance(grants, list) else []:
            token = grant.attempt.lease_token
            started = start_attempt.sync(
                "shop", grant.attempt.id, client=client, body=LeaseTokenRequest(lease_token=token)
            )
            if isinstance(started, Problem) or started is None:
                return [*seen, started.code if started else "no answer"]
            done = complete_attempt.sync(
                "shop", grant.attempt.id, client=client, body=CompleteRequest(lease_token=token)
            )
            seen.append(
                f"completed: {done.code if isinstance(done, Problem) else done.task_status if done else '?'}"
            )

        other = TaskSubmission(queue="fulfilment", handler="orders.other", params=params)
        reused = submit_task.sync("shop", client=client, body=other, idempotency_key="order-42")
        seen.append(reused.code if isinstance(reused, Problem) else "accepted")
    return seen


if __name__ == "__main__":
    print("\n".join(protocol(sys.argv[1], sys.argv[2])))
