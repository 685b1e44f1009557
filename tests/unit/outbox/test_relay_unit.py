"""The relay on a SQLite file with an in-memory fake server (``httpx.MockTransport``): every
outcome class, the attempt accounting, the lease fence, hooks and shutdown. Fast and deterministic."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import AuthenticationError, OrbitClient, PermissionDeniedError, RetryPolicy
from outbox_adapter import (
    Backoff,
    InvalidStateError,
    Outbox,
    OutboxRowError,
    OutboxSchemaError,
    OutboxTables,
    OutboxUsageError,
    Relay,
    RowNotFoundError,
    enqueue,
)
from outbox_adapter import _queries as q
from outbox_adapter._db import db_now

TASK = {
    "id": "t-1", "namespace": "shop", "queue": "default", "handler": "h", "status": "WAITING", "state_version": 1,
    "attempt_count": 0, "max_attempts": 3, "available_at": "2030-01-01T00:00:00Z",
    "created_at": "2030-01-01T00:00:00Z", "updated_at": "2030-01-01T00:00:00Z",
}  # fmt: skip
QUEUE = {"namespace": "shop", "name": "default", "created_at": "2030-01-01T00:00:00Z"}

Handler = Callable[[httpx.Request], httpx.Response]


def problem(status: int, code: str, **headers: str) -> httpx.Response:
    body = {"title": code, "status": status, "code": code}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json", **headers})


class FakeServer:
    """Answers queue checks with 200 and submissions with what ``submit`` returns for each row.

    A batch request (``POST .../tasks/batch``) is answered item by item: ``submit`` sees each
    item as the single request it stands for; a status a batch item cannot have (429, 5xx, ...)
    answers the whole request, as does an exception. With ``batch_route=False`` it is an older
    server: the batch route answers 405.
    """

    def __init__(self, submit: Handler, *, batch_route: bool = True) -> None:
        self.submit = submit
        self.batch_route = batch_route
        self.posts: list[str] = []  # idempotency keys, one per row sent
        self.requests: list[str] = []  # "batch" or "single", one per POST

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=QUEUE)
        if request.url.path.endswith("/tasks/batch"):
            if not self.batch_route:
                return problem(405, "method_not_allowed")
            self.requests.append("batch")
            return self._batch(request)
        self.requests.append("single")
        self.posts.append(request.headers["Idempotency-Key"])
        return self.submit(request)

    def _batch(self, request: httpx.Request) -> httpx.Response:
        results = []
        for item in json.loads(request.content)["items"]:
            key = item.pop("idempotency_key")
            self.posts.append(key)
            single = httpx.Request("POST", request.url.copy_with(path=request.url.path[: -len("/batch")]),
                                   headers={"Idempotency-Key": key}, json=item)  # fmt: skip
            response = self.submit(single)
            if response.status_code not in (200, 201, 400, 404, 409, 422):
                return response
            if response.status_code in (200, 201):
                results.append({"status": response.status_code, "task": response.json(),
                                "replayed": response.status_code == 200})  # fmt: skip
            else:
                results.append({"status": response.status_code, "error": response.json()})
        return httpx.Response(200, json={"items": results})


def accepted(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    return httpx.Response(201, json={**TASK, "id": f"task-{request.headers['Idempotency-Key']}", **body})


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'biz.db'}")
    Outbox(engine).migrate()
    yield engine
    engine.dispose()


def add(engine: sa.Engine, n: int = 1, **kwargs: Any) -> list[int]:
    with engine.begin() as conn:
        return [
            enqueue(conn, namespace="shop", queue="default", handler="h", params={"i": i}, **kwargs).id
            for i in range(n)
        ]


def relay(engine: sa.Engine, handler: Handler, **options: Any) -> Relay:
    client = OrbitClient("http://orbit.test", api_key="k", retry=RetryPolicy(max_attempts=1),
                         transport=httpx.MockTransport(handler))  # fmt: skip
    options.setdefault("backoff", Backoff.no_wait())
    return Relay(client=client, engine=engine, **options)


def test_accepted_and_replayed_are_delivered(engine: sa.Engine) -> None:
    add(engine, idempotency_key="new")
    add(engine, idempotency_key="seen-before")

    def submit(request: httpx.Request) -> httpx.Response:
        response = accepted(request)
        if request.headers["Idempotency-Key"] == "new":
            return response
        return httpx.Response(200, json=response.json(), headers={"Idempotent-Replayed": "true"})

    stats = relay(engine, FakeServer(submit)).run_once()
    assert (stats.delivered, stats.replayed) == (2, 1)
    rows = Outbox(engine).list_rows()
    assert [r.last_status_code for r in rows] == [201, 200] and all(r.orbit_task_id for r in rows)


@pytest.mark.parametrize(
    ("response", "state", "attempts", "status"),
    [
        (lambda r: problem(429, "rate_limited", **{"Retry-After": "30"}), "PENDING", 0, 429),
        (lambda r: problem(409, "request_in_progress"), "PENDING", 0, 409),
        (lambda r: problem(503, "unavailable"), "PENDING", 0, 503),
        (lambda r: problem(500, "internal_error"), "PENDING", 1, 500),
        (lambda r: problem(400, "idempotency_key_invalid"), "DEAD", 1, 400),
        (lambda r: problem(422, "validation_error"), "DEAD", 1, 422),
        (lambda r: problem(422, "idempotency_key_reused"), "NEEDS_RECONCILE", 1, 422),
    ],
)
def test_one_send_per_outcome_class(
    engine: sa.Engine, response: Handler, state: str, attempts: int, status: int
) -> None:
    [row_id] = add(engine)
    relay(engine, FakeServer(response), backoff=Backoff(base=5.0, cap=5.0, random=lambda: 1.0)).run_once()
    row = Outbox(engine).get(row_id)
    assert (row.state, row.attempts, row.send_count, row.last_status_code) == (state, attempts, 1, status)
    assert row.lease_token is None and row.lease_owner is None
    # Backoff from the database clock: Retry-After when given, else the jittered bound; none after a
    # 503: the server is down, which the relay waits out itself, not each row.
    if state == "PENDING":
        expected = {429: 30.0, 503: 0.0}.get(status, 5.0)
        assert abs((row.available_at - row.updated_at).total_seconds() - expected) < 0.01


def test_connection_refused_on_the_submission_is_not_counted(engine: sa.Engine) -> None:
    [row_id] = add(engine, max_attempts=1)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    for _ in range(3):  # however often it is refused, it never becomes NEEDS_RECONCILE
        assert relay(engine, FakeServer(refuse)).run_once().retried == 1
    row = Outbox(engine).get(row_id)
    assert (row.state, row.attempts, row.send_count) == ("PENDING", 0, 3)


def test_unknown_outcomes_spend_the_budget_then_needs_reconcile_never_dead(engine: sa.Engine) -> None:
    [row_id] = add(engine, max_attempts=3)
    server = FakeServer(lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("timed out", request=r)))
    stats = relay(engine, server).run_once()
    assert (stats.retried, stats.needs_reconcile, stats.dead) == (2, 1, 0)
    row = Outbox(engine).get(row_id)
    assert (row.state, row.attempts) == ("NEEDS_RECONCILE", 3)
    assert len(set(server.posts)) == 1 and len(server.posts) == 3  # the same key every time


def test_a_crashed_relay_counts_its_send_and_an_expired_spent_row_goes_to_reconcile(
    engine: sa.Engine,
) -> None:
    [row_id] = add(engine, max_attempts=1)
    with engine.begin() as conn:  # a relay claims and dies
        [claim], _ = q.claim_batch(conn, OutboxTables(), owner="dead", lease_seconds=0.0, limit=5,
                                   default_max_attempts=5, actor="relay:dead")  # fmt: skip
    server = FakeServer(accepted)
    stats = relay(engine, server).run_once()
    assert (stats.claimed, stats.needs_reconcile) == (0, 1) and server.posts == []
    row = Outbox(engine).get(row_id)
    assert row.state == "NEEDS_RECONCILE" and "lease" in (row.last_error or "")
    assert claim.attempts == 1


def test_a_lost_lease_records_nothing(engine: sa.Engine) -> None:
    [row_id] = add(engine)
    tables = OutboxTables()
    with engine.begin() as conn:
        [claim], _ = q.claim_batch(conn, tables, owner="a", lease_seconds=60, limit=1, default_max_attempts=5,
                                   actor="relay:a")  # fmt: skip
    with engine.begin() as conn:  # taken over: another claim after expiry would change the token
        conn.execute(sa.update(tables.outbox).values(lease_token="someone-else"))
    with engine.begin() as conn:
        assert not q.record_delivered(conn, tables, claim, now=db_now(conn), task_id="t", status_code=201)
    with engine.begin() as conn:  # and a lease past its end cannot record either
        conn.execute(sa.update(tables.outbox).values(lease_token=claim.token, lease_expires_at=db_now(conn)))
        assert not q.record_dead(conn, tables, claim, now=db_now(conn), error="x", status_code=400)
    assert Outbox(engine).get(row_id).state == "PENDING"


def test_on_delivered_runs_in_the_recording_transaction_and_a_failure_leaves_only_its_row(
    engine: sa.Engine,
) -> None:
    ids = add(engine, 3)
    links = sa.Table(
        "links", sa.MetaData(), sa.Column("row_id", sa.Integer), sa.Column("task_id", sa.String(80))
    )
    links.create(engine)

    def link(conn: sa.Connection, row: Any) -> None:
        if row.row_id == ids[1]:
            raise RuntimeError("hook bug")
        conn.execute(links.insert().values(row_id=row.row_id, task_id=row.orbit_task_id))

    stats = relay(engine, FakeServer(accepted), on_delivered=link, concurrency=1).run_once()
    assert stats.delivered == 2
    outbox = Outbox(engine)
    assert [outbox.get(i).state for i in ids] == ["DELIVERED", "PENDING", "DELIVERED"]
    with engine.connect() as conn:
        assert sorted(r.row_id for r in conn.execute(sa.select(links))) == [ids[0], ids[2]]


def test_stop_releases_unsent_claims_and_finishes_the_sends_in_flight(engine: sa.Engine) -> None:
    with engine.begin() as conn:  # five namespaces: one claim, five batch requests, one in flight at a time
        ids = [
            enqueue(conn, namespace=f"shop{i}", queue="default", handler="h", params={}).id for i in range(5)
        ]
    arrived, release = threading.Event(), threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        arrived.set()
        release.wait(10)
        return accepted(request)

    the_relay = relay(engine, FakeServer(slow), concurrency=1, batch_size=5)
    result: dict[str, Any] = {}
    draining = threading.Event()  # logged once the relay has cancelled the sends not yet started

    class _Draining(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) == "draining":
                draining.set()

    watcher = _Draining()
    relay_log = logging.getLogger("outbox_adapter.relay")
    relay_log.addHandler(watcher)
    level = relay_log.level
    relay_log.setLevel(logging.INFO)
    try:
        thread = threading.Thread(target=lambda: result.update(stats=the_relay.run()))
        thread.start()
        assert arrived.wait(10)
        the_relay.stop()
        assert draining.wait(10)  # not before: a released send would let the next queued one start
        release.set()
        thread.join(10)
    finally:
        relay_log.removeHandler(watcher)
        relay_log.setLevel(level)
    stats = result["stats"]
    assert (stats.delivered, stats.released) == (1, 4)
    rows = Outbox(engine).list_rows()
    assert [r.state for r in rows] == ["DELIVERED"] + ["PENDING"] * 4
    assert all(r.lease_token is None and r.attempts == 0 for r in rows[1:])
    assert [r.id for r in rows] == ids


def test_operator_errors_name_the_row_and_the_fix(engine: sa.Engine) -> None:
    [row_id] = add(engine)
    outbox = Outbox(engine)
    with pytest.raises(RowNotFoundError) as missing:
        outbox.retry(999, actor="t")
    assert missing.value.row_id == 999 and "999" in str(missing.value)
    with pytest.raises(InvalidStateError) as wrong:
        outbox.retry(row_id, actor="t")
    assert (wrong.value.row_id, wrong.value.state) == (row_id, "PENDING") and "only DEAD" in str(wrong.value)
    with pytest.raises(OutboxSchemaError, match="orbit-outbox migrate"):
        Outbox(engine, tables=OutboxTables(name="never_migrated")).status()


@pytest.mark.parametrize(
    ("submit", "unavailable"),
    [
        (lambda r: (_ for _ in ()).throw(httpx.ConnectError("[Errno 111] Connection refused", request=r)), 1),
        (lambda r: problem(503, "unavailable"), 1),
        (lambda r: problem(429, "rate_limited"), 0),
        (lambda r: problem(422, "validation_error"), 0),  # DEAD: drained, not unavailable
        (lambda r: problem(422, "idempotency_key_reused"), 0),  # NEEDS_RECONCILE: drained
        (accepted, 0),
    ],
)
def test_rows_left_unsent_because_orbit_is_unavailable_are_counted(
    engine: sa.Engine, submit: Handler, unavailable: int
) -> None:
    add(engine)
    stats = relay(engine, FakeServer(submit), backoff=Backoff(base=5.0, cap=5.0)).run_once()
    assert stats.orbit_unavailable == unavailable and stats.to_dict()["orbit_unavailable"] == unavailable


@pytest.mark.parametrize(("status", "error"), [(401, AuthenticationError), (403, PermissionDeniedError)])
def test_a_refused_key_stops_the_relay_and_the_rows_stay_due_with_their_attempts(
    engine: sa.Engine, status: int, error: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    """A 401/403 is a configuration error, not an outage (issue 30): the relay that runs until stopped
    claims nothing more, says once which key and what to do, and raises; it used to retry every row for
    ever, logging an error per row."""
    ids = add(engine, 3)
    server = FakeServer(lambda r: problem(status, "unauthenticated" if status == 401 else "forbidden"))
    the_relay = relay(engine, server, batch_size=1, concurrency=1, backoff=Backoff(base=60, cap=60))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            the_relay.run()
        except BaseException as exc:
            raised.append(exc)

    caplog.set_level(logging.DEBUG, "outbox_adapter")
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        the_relay.stop()
        thread.join(10)
        pytest.fail("the relay kept running with a refused key")
    assert len(raised) == 1 and isinstance(raised[0], error)
    assert len(server.posts) == 1  # nothing more was claimed or sent
    rows = [Outbox(engine).get(i) for i in ids]
    assert [(r.state, r.attempts) for r in rows] == [("PENDING", 0)] * 3
    assert all(r.available_at <= r.updated_at for r in rows)  # due: no backoff spent on the relay's key
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [getattr(r, "event", None) for r in errors] == ["api_key_refused"]
    assert "k…" in errors[0].getMessage() and "ORBIT_API_KEY" in errors[0].getMessage()


def test_a_row_refused_then_delivered_in_the_same_run_is_not_counted_unavailable(engine: sa.Engine) -> None:
    add(engine, max_attempts=3)
    answers = iter([httpx.ReadTimeout("timed out"), None])

    def flaky(request: httpx.Request) -> httpx.Response:
        error = next(answers)
        if error is not None:
            raise httpx.ReadTimeout("timed out", request=request)
        return accepted(request)

    stats = relay(engine, FakeServer(flaky)).run_once()  # zero backoff: the row is due again in this run
    assert (stats.retried, stats.delivered, stats.orbit_unavailable) == (1, 1, 0)


def _task_server(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/namespaces/shop/tasks/t-9":
        return httpx.Response(200, json={**TASK, "id": "t-9"})
    return problem(404, "task_not_found")


def _needs_reconcile(engine: sa.Engine, n: int = 1) -> list[int]:
    ids = add(engine, n)
    with engine.begin() as conn:
        conn.execute(sa.update(OutboxTables().outbox).values(state="NEEDS_RECONCILE", last_error="mismatch"))
    return ids


def test_resolve_settles_a_row_left_for_a_person_audited_and_conditional(engine: sa.Engine) -> None:
    delivered, abandoned, unknown = _needs_reconcile(engine, 3)
    outbox = Outbox(engine)
    client = OrbitClient("http://orbit.test", api_key="k", transport=httpx.MockTransport(_task_server))

    row = outbox.resolve(delivered, delivered_as="t-9", client=client, actor="ops:alice", reason="found it")
    assert (row.state, row.orbit_task_id, row.last_error) == ("DELIVERED", "t-9", None)
    assert row.delivered_at is not None
    [event] = outbox.events(delivered)
    assert (event.from_state, event.to_state, event.actor, event.orbit_task_id) == (
        "NEEDS_RECONCILE", "DELIVERED", "ops:alice", "t-9",
    )  # fmt: skip
    assert "found it" in event.reason

    row = outbox.resolve(abandoned, abandon=True, actor="ops:bob", reason="order was cancelled")
    assert (row.state, row.last_error) == ("ABANDONED", "abandoned by operator: order was cancelled")
    [event] = outbox.events(abandoned)
    assert (event.to_state, event.actor) == ("ABANDONED", "ops:bob") and "order was cancelled" in event.reason

    with pytest.raises(OutboxRowError, match=f"no task 'nope'.*row {unknown} stays NEEDS_RECONCILE"):
        outbox.resolve(unknown, delivered_as="nope", client=client, actor="t", reason="r")
    with pytest.raises(
        InvalidStateError, match=f"row {delivered} is DELIVERED, not NEEDS_RECONCILE"
    ) as wrong:
        outbox.resolve(delivered, abandon=True, actor="t", reason="r")  # a second decision changes nothing
    assert (wrong.value.row_id, wrong.value.state) == (delivered, "DELIVERED")
    with pytest.raises(InvalidStateError, match=f"row {abandoned} is ABANDONED.*nothing to resolve"):
        outbox.resolve(abandoned, delivered_as="t-9", client=client, actor="t", reason="r")
    with pytest.raises(InvalidStateError, match="ABANDONED row is never sent"):
        outbox.retry(abandoned, actor="t")
    with pytest.raises(RowNotFoundError):
        outbox.resolve(999, abandon=True, actor="t", reason="r")
    for bad in ({}, {"abandon": True, "delivered_as": "t-9", "client": client}, {"delivered_as": "t-9"}):
        with pytest.raises(OutboxUsageError):
            outbox.resolve(unknown, actor="t", reason="r", **bad)  # type: ignore[arg-type]
    with pytest.raises(OutboxUsageError, match="reason"):
        outbox.resolve(unknown, abandon=True, actor="t", reason=" ")
    assert outbox.get(unknown).state == "NEEDS_RECONCILE" and outbox.events(unknown) == []
    client.close()


def test_resolve_records_nothing_when_the_row_changed_meanwhile(engine: sa.Engine) -> None:
    [row_id] = _needs_reconcile(engine)
    outbox = Outbox(engine)

    def changed_meanwhile(request: httpx.Request) -> httpx.Response:  # reconcile decides during the lookup
        with engine.begin() as conn:
            conn.execute(sa.update(OutboxTables().outbox).values(state="PENDING"))
        return _task_server(request)

    client = OrbitClient("http://orbit.test", api_key="k", transport=httpx.MockTransport(changed_meanwhile))
    with pytest.raises(InvalidStateError, match="changed meanwhile and is now PENDING"):
        outbox.resolve(row_id, delivered_as="t-9", client=client, actor="t", reason="r")
    assert outbox.get(row_id).state == "PENDING" and outbox.events(row_id) == []
    client.close()


def test_reconcile_leaves_a_mismatch_for_a_person_and_says_nothing_was_applied(engine: sa.Engine) -> None:
    [row_id] = _needs_reconcile(engine)

    def other_submission(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**TASK, "id": "t-other", "handler": "someone.else"})

    client = OrbitClient("http://orbit.test", api_key="k", transport=httpx.MockTransport(other_submission))
    [decision] = Outbox(engine).reconcile(client, actor="t")
    client.close()
    assert (decision.decision, decision.applied) == ("mismatch", False)
    assert f"orbit-outbox resolve {row_id}" in decision.detail
    row = Outbox(engine).get(row_id)
    assert row.state == "NEEDS_RECONCILE" and "a person must decide" in (row.last_error or "")


def test_one_request_per_batch_and_a_whole_request_failure_counts_every_row(engine: sa.Engine) -> None:
    ids = add(engine, 3, max_attempts=2)
    answers = iter(["timeout", "ok"])

    def flaky(request: httpx.Request) -> httpx.Response:
        if next(answers) == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        return accepted(request)

    class Once(FakeServer):  # the outcome of the whole request is unknown once, then all are accepted
        def _batch(self, request: httpx.Request) -> httpx.Response:
            if next(answers) == "timeout":
                self.posts.extend(item["idempotency_key"] for item in json.loads(request.content)["items"])
                raise httpx.ReadTimeout("timed out", request=request)
            return super()._batch(request)

    server = Once(accepted)
    stats = relay(engine, server, batch_size=10).run_once()
    assert server.requests == ["batch", "batch"] and (stats.retried, stats.delivered) == (3, 3)
    rows = Outbox(engine).list_rows()
    assert [(r.id, r.state, r.attempts) for r in rows] == [(i, "DELIVERED", 2) for i in ids]


def test_once_unknown_a_later_refusal_needs_reconcile_never_dead(engine: sa.Engine) -> None:
    [row_id] = add(engine, max_attempts=3)
    answers = iter([None, problem(422, "validation_error")])

    def submit(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if answer is None:
            raise httpx.ReadTimeout("timed out", request=request)
        return answer

    stats = relay(engine, FakeServer(submit)).run_once()
    assert (stats.retried, stats.dead, stats.needs_reconcile) == (1, 0, 1)
    row = Outbox(engine).get(row_id)
    assert row.state == "NEEDS_RECONCILE" and "earlier send(s) had an unknown outcome" in (
        row.last_error or ""
    )


def test_an_older_server_gets_single_submissions_with_queue_checks(engine: sa.Engine) -> None:
    add(engine, 3)
    server = FakeServer(accepted, batch_route=False)
    seen: list[str] = []

    def transport(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        return server(request)

    stats = relay(engine, transport, batch_size=3, concurrency=1).run_once()
    assert (stats.delivered, stats.released) == (3, 3) and server.requests == ["single"] * 3
    assert seen.count("GET") == 1  # the queue check, cached


def test_the_on_delivered_hook_runs_once_per_row_of_a_batch_in_one_transaction(engine: sa.Engine) -> None:
    ids = add(engine, 4)
    calls: list[tuple[int, int]] = []

    def hook(conn: sa.Connection, row: Any) -> None:
        calls.append((id(conn), row.row_id))

    relay(engine, FakeServer(accepted), on_delivered=hook, batch_size=4).run_once()
    assert [row_id for _, row_id in calls] == ids and len({conn for conn, _ in calls}) == 1


def test_a_claim_goes_as_requests_the_server_takes(engine: sa.Engine) -> None:
    from outbox_adapter._sending import MAX_BATCH_BYTES, MAX_BATCH_ITEMS, requests_of

    def claim(i: int, params: Any) -> q.Claim:
        return q.Claim(id=i, idempotency_key=f"k{i}", namespace="shop", queue="default", handler="h",
                       ordering_key=None, business_ref=None, attempts=1, send_count=1, budget=5, token="t",
                       lease_expires_at=datetime(2030, 1, 1), params=params)  # fmt: skip

    small = [claim(i, {"i": i}) for i in range(1200)]
    assert [len(r) for r in requests_of(small)] == [MAX_BATCH_ITEMS, MAX_BATCH_ITEMS, 200]
    big = "x" * (MAX_BATCH_BYTES // 2)
    mixed = [claim(0, {"b": big}), claim(1, {"b": big}), claim(2, {}), claim(3, {"b": "x" * MAX_BATCH_BYTES})]
    assert [[c.id for c in r] for r in requests_of(mixed)] == [[0], [1, 2], [3]]


def test_a_batch_refused_as_a_whole_is_sent_row_by_row(engine: sa.Engine) -> None:
    add(engine, 2)
    server = FakeServer(accepted)

    def transport(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/tasks/batch"):  # e.g. a server taking fewer items per request
            server.requests.append("batch")
            return problem(422, "validation_error")
        return server(request)

    stats = relay(engine, transport, batch_size=2).run_once()
    assert stats.delivered == 2 and server.requests == ["batch", "single", "single"]
