"""Examples of the OpenAPI document: request bodies, the main answers and the common problems, as a client
author reads them in Swagger UI, ReDoc, the docs site's HTTP API reference and generated clients.

They tell one story: the shop's order ``A-1042`` asks for a receipt e-mail on the ``emails`` queue; a worker
leases, starts, heartbeats and completes it; a subscription delivers the result. Ids, lease tokens and
timestamps have the server's shapes (UUIDs, ``secrets.token_urlsafe(32)``, UTC with microseconds and
``Z``). :func:`orbit_server.api.openapi._finish_openapi` puts them in the document; a test validates each
against its schema and parses it with its model (``tests/unit/test_openapi_examples.py``), so they cannot
drift from the models.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PROBLEM_EXAMPLES",
    "REQUEST_EXAMPLES",
    "RESPONSE_EXAMPLES",
    "SCHEMA_EXAMPLES",
]

_TASK_ID = "30e5ad52-c568-477a-969c-14036c7d5f17"
_TASK_2_ID = "16b2926e-f1e0-4d0a-aa6e-0370563afa53"
_ATTEMPT_ID = "ae27e1ef-231b-4054-9521-88a4f9b82357"
_ATTEMPT_2_ID = "24741e0e-1715-46e6-a0f6-5aeff58caf75"
_TOKEN = "UeL2HrpKj1TOkg7DUqVdUVAsP-_F00u0on8R9i_fHvo"
_TOKEN_2 = "1P5bA5eSVGxjLmbB7-Og3S71TGSqVvKcALcvxQJEZFY"
_PARAMS = {"order_id": "A-1042", "email": "ada@example.com"}

# --------------------------------------------------------------------------------------------------
# Tasks

_TASK_WAITING: dict[str, Any] = {
    "id": _TASK_ID,
    "namespace": "shop",
    "queue": "emails",
    "handler": "send_receipt",
    "params": _PARAMS,
    "status": "WAITING",
    "state_version": 1,
    "attempt_count": 0,
    "max_attempts": 5,
    "retry_safe": True,
    "available_at": "2026-12-05T09:14:03.127000Z",
    "deadline": "2026-12-06T09:00:00.000000Z",
    "cancel_requested": False,
    "result": None,
    "error": None,
    "retry_of": None,
    "created_at": "2026-12-05T09:14:03.127000Z",
    "updated_at": "2026-12-05T09:14:03.127000Z",
    "current_attempt_id": None,
    "cancel_reason": None,
    "backoff_base_seconds": 2.0,
    "backoff_cap_seconds": 600.0,
    "finished_at": None,
    "concurrency_key": "customer-7731",
    "priority": 10,
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": None,
}
_TASK_LEASED = _TASK_WAITING | {
    "status": "LEASED",
    "state_version": 2,
    "attempt_count": 1,
    "updated_at": "2026-12-05T09:14:03.410000Z",
    "current_attempt_id": _ATTEMPT_ID,
}
_TASK_SUCCEEDED = _TASK_LEASED | {
    "status": "SUCCEEDED",
    "state_version": 4,
    "result": {"message_id": "<20261205091421.4711@mail.example.com>"},
    "updated_at": "2026-12-05T09:14:21.905000Z",
    "finished_at": "2026-12-05T09:14:21.905000Z",
}
_TASK_CANCEL_REQUESTED = _TASK_LEASED | {
    "status": "RUNNING",
    "state_version": 4,
    "cancel_requested": True,
    "cancel_reason": "order A-1042 was cancelled by the customer",
    "updated_at": "2026-12-05T09:14:12.318000Z",
}
_TASK_2_WAITING = {
    "id": _TASK_2_ID,
    "namespace": "shop",
    "queue": "emails",
    "handler": "send_receipt",
    "params": {"order_id": "A-1043", "email": "grace@example.com"},
    "status": "WAITING",
    "state_version": 1,
    "attempt_count": 0,
    "max_attempts": 3,
    "retry_safe": False,
    "available_at": "2026-12-05T09:14:05.532000Z",
    "deadline": None,
    "cancel_requested": False,
    "result": None,
    "error": None,
    "retry_of": None,
    "created_at": "2026-12-05T09:14:05.532000Z",
    "updated_at": "2026-12-05T09:14:05.532000Z",
    "current_attempt_id": None,
    "cancel_reason": None,
    "backoff_base_seconds": None,
    "backoff_cap_seconds": None,
    "finished_at": None,
    "concurrency_key": None,
    "priority": 0,
    "traceparent": None,
    "tracestate": None,
}
_TASK_2_LEASED = _TASK_2_WAITING | {
    "status": "LEASED",
    "state_version": 2,
    "attempt_count": 1,
    "updated_at": "2026-12-05T09:14:21.931000Z",
    "current_attempt_id": _ATTEMPT_2_ID,
}
_TASK_RETRIED = _TASK_2_WAITING | {
    "id": "0aaffc04-25fb-4a77-9faf-50a282c733bc",
    "available_at": "2026-12-05T10:02:44.016000Z",
    "deadline": "2026-12-06T12:00:00.000000Z",
    "retry_of": _TASK_2_ID,
    "created_at": "2026-12-05T10:02:44.016000Z",
    "updated_at": "2026-12-05T10:02:44.016000Z",
}

_SUBMISSION = {"queue": "emails", "handler": "send_receipt", "params": _PARAMS}
_SUBMISSION_WITH_OPTIONS = _SUBMISSION | {
    "options": {
        "max_attempts": 5,
        "retry_safe": True,
        "deadline": "2026-12-06T09:00:00Z",
        "backoff_base_seconds": 2.0,
        "backoff_cap_seconds": 600.0,
        "concurrency_key": "customer-7731",
        "priority": 10,
    }
}

# --------------------------------------------------------------------------------------------------
# Problems (RFC 9457): the body of every error answer

_REUSED = {
    "type": "about:blank",
    "title": "Idempotency key already used for another request",
    "status": 422,
    "detail": "this Idempotency-Key was already used with a different queue, handler, params or options; "
    "use a new key for a new task",
    "code": "idempotency_key_reused",
    "request_id": "df3b7ad19ac0441993b79e31e199e20b",
}
_LEASE_LOST = {
    "type": "about:blank",
    "title": "The attempt no longer holds the task's lease",
    "status": 409,
    "detail": "the lease token does not belong to this attempt",
    "code": "lease_lost",
    "request_id": "38f8280939f6480c824bd45a5f5ab9b7",
    "evidence_recorded": False,
}
_VALIDATION_ERROR = {
    "type": "about:blank",
    "title": "The request is not valid",
    "status": 422,
    "detail": "body.queue: String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'",
    "code": "validation_error",
    "request_id": "92d8ab3abd8f4eeb80a4a50a62c95f9e",
    "errors": [
        {
            "loc": ["body", "queue"],
            "msg": "String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'",
            "type": "string_pattern_mismatch",
        }
    ],
}

#: Problem bodies by ``code``, with a summary each.
PROBLEM_EXAMPLES: dict[str, dict[str, Any]] = {
    "idempotency_key_reused": {
        "summary": "idempotency_key_reused: the key was used for a different request",
        "value": _REUSED,
    },
    "lease_lost": {
        "summary": "lease_lost: the attempt lost its lease (expired, or a newer attempt holds the task)",
        "value": _LEASE_LOST,
    },
    "validation_error": {
        "summary": "validation_error: the body is not valid; `errors` says where",
        "value": _VALIDATION_ERROR,
    },
}

# --------------------------------------------------------------------------------------------------
# Execution: leases, attempts, reports

_GRANT = {
    "task": _TASK_LEASED,
    "attempt": {
        "id": _ATTEMPT_ID,
        "generation": 1,
        "lease_token": _TOKEN,
        "lease_expires_at": "2026-12-05T09:14:33.410000Z",
    },
}
_GRANT_2 = {
    "task": _TASK_2_LEASED,
    "attempt": {
        "id": _ATTEMPT_2_ID,
        "generation": 1,
        "lease_token": _TOKEN_2,
        "lease_expires_at": "2026-12-05T09:14:51.931000Z",
    },
}


def _state(status: str, task_status: str, expires: str, *, cancel: bool = False) -> dict[str, Any]:
    return {
        "attempt_id": _ATTEMPT_ID,
        "task_id": _TASK_ID,
        "generation": 1,
        "status": status,
        "task_status": task_status,
        "lease_expires_at": expires,
        "cancel_requested": cancel,
    }


_STARTED = _state("RUNNING", "RUNNING", "2026-12-05T09:14:33.452000Z")
_RENEWED = _state("RUNNING", "RUNNING", "2026-12-05T09:15:18.460000Z")
_RENEWED_CANCEL = _state("RUNNING", "RUNNING", "2026-12-05T09:15:18.460000Z", cancel=True)
_SUCCEEDED = _state("SUCCEEDED", "SUCCEEDED", "2026-12-05T09:15:18.460000Z")
_FAILED_RETRY = _state("FAILED", "WAITING", "2026-12-05T09:15:18.460000Z")
_ATTEMPT_2_STARTED = _STARTED | {"attempt_id": _ATTEMPT_2_ID, "task_id": _TASK_2_ID}

_RESULT = {"message_id": "<20261205091421.4711@mail.example.com>"}
_ERROR = {
    "type": "TimeoutError",
    "message": "the SMTP server did not answer within 10 s",
    "retryable": True,
    "traceback": "Traceback (most recent call last):\n"
    '  File "/srv/shop/tasks.py", line 41, in send_receipt\n'
    "    smtp.send_message(message)\n"
    "TimeoutError: the SMTP server did not answer within 10 s\n",
}
_NEXT_LEASE = {"queue": "emails", "worker_id": "worker-7f3a", "max_tasks": 1, "lease_seconds": 30.0}


def _ok(state: dict[str, Any]) -> dict[str, Any]:
    return {"status": 200, "attempt": state, "error": None}


_LOST_ITEM = {"status": 409, "attempt": None, "error": _LEASE_LOST}

# --------------------------------------------------------------------------------------------------
# Results: deliveries

_DELIVERY = {
    "id": "1842",
    "subscription": "billing",
    "delivery_count": 1,
    "lease_expires_at": "2026-12-05T09:15:02.117000Z",
    "event": {
        "id": "6e5c65cb-9457-4e1f-bf9d-7d342d00a2aa",
        "task_id": _TASK_ID,
        "namespace": "shop",
        "queue": "emails",
        "handler": "send_receipt",
        "status": "SUCCEEDED",
        "result": _RESULT,
        "error": None,
        "occurred_at": "2026-12-05T09:14:21.905000Z",
        "idempotency_key": "order-A-1042-receipt",
        "retry_of": None,
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": None,
    },
}


def _example(summary: str, value: Any) -> dict[str, Any]:
    return {"summary": summary, "value": value}


#: Named request-body examples, by operationId.
REQUEST_EXAMPLES: dict[str, dict[str, dict[str, Any]]] = {
    "submit_task": {
        "minimal": _example("A task: queue, handler and its params", _SUBMISSION),
        "with_options": _example(
            "With options: attempts, retry safety, deadline, backoff, concurrency key, priority",
            _SUBMISSION_WITH_OPTIONS,
        ),
    },
    "submit_tasks": {
        "two_items": _example(
            "Two submissions, each with its own idempotency key",
            {
                "items": [
                    {"idempotency_key": "order-A-1042-receipt"} | _SUBMISSION_WITH_OPTIONS,
                    {
                        "idempotency_key": "order-A-1043-receipt",
                        "queue": "emails",
                        "handler": "send_receipt",
                        "params": {"order_id": "A-1043", "email": "grace@example.com"},
                        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                    },
                ]
            },
        ),
    },
    "lease_tasks": {
        "long_poll": _example(
            "Up to 10 tasks, waiting up to 20 s for one to come due",
            {"worker_id": "worker-7f3a", "max_tasks": 10, "lease_seconds": 30.0, "wait_seconds": 20.0},
        ),
        "lease_and_start": _example(
            "Lease-and-start: retry-safe tasks come back already RUNNING",
            {"worker_id": "worker-7f3a", "max_tasks": 10, "lease_seconds": 30.0, "start": True},
        ),
    },
    "start_attempt": {"start": _example("The lease token of the grant", {"lease_token": _TOKEN})},
    "heartbeat_attempt": {
        "renew": _example("Renew the lease for 60 s", {"lease_token": _TOKEN, "lease_seconds": 60.0}),
        "same_duration": _example("Renew for the duration of the lease", {"lease_token": _TOKEN}),
    },
    "complete_attempt": {
        "complete": _example("The handler's JSON result", {"lease_token": _TOKEN, "result": _RESULT}),
    },
    "fail_attempt": {
        "retryable": _example(
            "A retryable failure, with the handler's traceback", {"lease_token": _TOKEN, "error": _ERROR}
        ),
        "cancelled": _example(
            "The handler stopped because cancellation was requested",
            {
                "lease_token": _TOKEN,
                "error": {"type": "cancelled", "message": "cancellation was requested", "retryable": False},
            },
        ),
    },
    "start_attempts": {
        "two": _example(
            "Start two attempts",
            {
                "items": [
                    {"attempt_id": _ATTEMPT_ID, "lease_token": _TOKEN},
                    {"attempt_id": _ATTEMPT_2_ID, "lease_token": _TOKEN_2},
                ]
            },
        ),
    },
    "heartbeat_attempts": {
        "two": _example(
            "Renew two leases",
            {
                "items": [
                    {"attempt_id": _ATTEMPT_ID, "lease_token": _TOKEN, "lease_seconds": 60.0},
                    {"attempt_id": _ATTEMPT_2_ID, "lease_token": _TOKEN_2, "lease_seconds": 60.0},
                ]
            },
        ),
    },
    "complete_attempts": {
        "report_and_lease": _example(
            "Report-and-lease: complete, and lease the next task in the same call",
            {
                "items": [{"attempt_id": _ATTEMPT_ID, "lease_token": _TOKEN, "result": _RESULT}],
                "lease": _NEXT_LEASE,
            },
        ),
        "reports_only": _example(
            "Complete two attempts",
            {
                "items": [
                    {"attempt_id": _ATTEMPT_ID, "lease_token": _TOKEN, "result": _RESULT},
                    {"attempt_id": _ATTEMPT_2_ID, "lease_token": _TOKEN_2, "result": None},
                ]
            },
        ),
    },
    "fail_attempts": {
        "report_and_lease": _example(
            "Report-and-lease: fail, and lease the next task in the same call",
            {
                "items": [{"attempt_id": _ATTEMPT_ID, "lease_token": _TOKEN, "error": _ERROR}],
                "lease": _NEXT_LEASE,
            },
        ),
    },
    "cancel_task": {
        "cancel": _example("Why (audited)", {"reason": "order A-1042 was cancelled by the customer"}),
    },
    "retry_task": {
        "retry": _example(
            "A successor with a new deadline",
            {"reason": "SMTP credentials fixed (INC-2291)", "deadline": "2026-12-06T12:00:00Z"},
        ),
    },
    "review_task": {
        "succeeded": _example(
            "The reviewer found that the work was done",
            {
                "outcome": "succeeded",
                "reason": "the provider's dashboard shows the charge captured once",
                "evidence_ref": "psp:ch_3QbX9k2eZvKYlo2C1x8Yb7Tq",
                "result": {"captured": True, "amount_cents": 4200},
                "actor": "ada.lovelace",
            },
        ),
        "failed": _example(
            "The reviewer found that it was not",
            {
                "outcome": "failed",
                "reason": "no charge at the provider; the customer will be asked to pay again",
                "evidence_ref": "TICKET-4411",
                "actor": "ada.lovelace",
            },
        ),
    },
    "create_schedule": {
        "cron": _example(
            "Weekdays at 06:00, Paris time",
            {
                "name": "daily-sales-report",
                "queue": "reports",
                "handler": "send_sales_report",
                "params": {"recipients": ["sales@example.com"]},
                "cron": "0 6 * * 1-5",
                "timezone": "Europe/Paris",
                "misfire_policy": "run_once",
                "overlap_policy": "skip_if_running",
            },
        ),
        "interval": _example(
            "Every 15 minutes from a start time, until an end time",
            {
                "name": "sync-inventory",
                "queue": "sync",
                "handler": "sync_inventory",
                "interval_seconds": 900,
                "start_at": "2026-12-05T10:00:00Z",
                "end_at": "2027-01-31T23:59:59Z",
                "options": {"max_attempts": 1},
            },
        ),
    },
    "create_subscription": {
        "some_queues": _example(
            "The result events of two queues", {"name": "billing", "queues": ["emails", "payments"]}
        ),
        "every_queue": _example("The result events of every queue, later ones included", {"name": "audit"}),
    },
    "lease_deliveries": {
        "lease": _example("Up to 50 deliveries for 30 s", {"max": 50, "lease_seconds": 30.0}),
    },
    "start_flow": {
        "newest": _example("Run the newest version", {"input": {"order_id": "A-1042", "amount_cents": 4200}}),
        "pinned": _example(
            "Run version 3", {"input": {"order_id": "A-1042", "amount_cents": 4200}, "version": 3}
        ),
    },
    "signal_flow": {
        "signal": _example(
            "A named signal with a JSON payload",
            {
                "name": "payment_confirmed",
                "payload": {"provider_ref": "pi_3QbX9k2eZvKYlo2C", "amount_cents": 4200},
            },
        ),
    },
}

#: Named examples of successful answers, by operationId and status.
RESPONSE_EXAMPLES: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("submit_task", "201"): {"created": _example("A new task", _TASK_WAITING)},
    ("submit_task", "200"): {
        "replayed": _example(
            "A replay (`Idempotent-Replayed: true`): the original task, as it is now", _TASK_SUCCEEDED
        )
    },
    ("submit_tasks", "200"): {
        "mixed": _example(
            "One result per item, in order: a new task, a replay, a reused key",
            {
                "items": [
                    {"status": 201, "task": _TASK_2_WAITING, "error": None, "replayed": False},
                    {"status": 200, "task": _TASK_SUCCEEDED, "error": None, "replayed": True},
                    {"status": 422, "task": None, "error": _REUSED, "replayed": False},
                ]
            },
        ),
    },
    ("get_task", "200"): {
        "succeeded": _example("A task that succeeded", _TASK_SUCCEEDED),
        "cancel_requested": _example("Cancellation requested while it runs", _TASK_CANCEL_REQUESTED),
    },
    ("cancel_task", "200"): {
        "cancel_requested": _example(
            "Running: the worker is told at its next heartbeat", _TASK_CANCEL_REQUESTED
        ),
    },
    ("retry_task", "201"): {"successor": _example("The successor task", _TASK_RETRIED)},
    ("lease_tasks", "200"): {
        "one_grant": _example("One task granted, with its attempt's fencing token", [_GRANT]),
        "nothing_due": _example("Nothing was due within `wait_seconds`", []),
    },
    ("start_attempt", "200"): {"running": _example("Started", _STARTED)},
    ("heartbeat_attempt", "200"): {
        "renewed": _example("Renewed", _RENEWED),
        "cancel_requested": _example(
            "Renewed; cancellation was requested: stop and fail with `cancelled`", _RENEWED_CANCEL
        ),
    },
    ("complete_attempt", "200"): {"succeeded": _example("Completed", _SUCCEEDED)},
    ("fail_attempt", "200"): {
        "will_retry": _example("Failed; the task waits for its next attempt", _FAILED_RETRY),
    },
    ("start_attempts", "200"): {
        "both": _example("Both started", {"items": [_ok(_STARTED), _ok(_ATTEMPT_2_STARTED)]}),
    },
    ("heartbeat_attempts", "200"): {
        "one_lost": _example(
            "One renewed, one whose lease was lost (the other items are not undone)",
            {"items": [_ok(_RENEWED), _LOST_ITEM]},
        ),
    },
    ("complete_attempts", "200"): {
        "report_and_lease": _example(
            "The report, then the next grant",
            {"items": [_ok(_SUCCEEDED)], "grants": [_GRANT_2], "lease_error": None},
        ),
        "reports_only": _example(
            "Without a lease request: `grants` and `lease_error` are absent",
            {"items": [_ok(_SUCCEEDED), _LOST_ITEM]},
        ),
    },
    ("fail_attempts", "200"): {
        "report_and_lease": _example(
            "The report, then the next grant",
            {"items": [_ok(_FAILED_RETRY)], "grants": [_GRANT_2], "lease_error": None},
        ),
    },
    ("lease_deliveries", "200"): {
        "one": _example("One result event, until acked", [_DELIVERY]),
    },
}

#: Examples of the main component schemas (JSON Schema ``examples``), by schema name. Not ``Problem``:
#: Swagger UI and the docs site show a schema's first example for every answer without its own, so each
#: 401 and 404 would show an ``idempotency_key_reused`` body.
SCHEMA_EXAMPLES: dict[str, list[Any]] = {
    "Task": [_TASK_WAITING],
    "LeaseGrant": [_GRANT],
    "AttemptState": [_STARTED],
    "AttemptBatchResponse": [RESPONSE_EXAMPLES[("complete_attempts", "200")]["report_and_lease"]["value"]],
    "Delivery": [_DELIVERY],
    "TaskSubmission": [_SUBMISSION_WITH_OPTIONS],
    "LeaseRequest": [REQUEST_EXAMPLES["lease_tasks"]["long_poll"]["value"]],
}
