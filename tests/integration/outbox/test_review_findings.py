"""Regression tests for what a review of the outbox paths found (issue 9, item 4), each replaying
its interleaving against real business databases (SQLite, MariaDB, PostgreSQL) and a real server.

- Per-key order is commit order: T1 enqueues row 1 with key K and stays open, T2 enqueues row 2
  with K; T2 now waits for T1 (the key's row is locked) and the relay sends row 1 first.
- A ``DEAD`` head row no longer blocks its key for ever: ``status`` names the key and the row,
  ``abandon`` (audited) makes it ``ABANDONED`` and the key's later rows go out.
- ``on_delivered`` raising a database error (or leaving the transaction unusable) leaves only
  its row to its lease; the rest of the batch is recorded and the relay keeps running.
- Once a send of a row had an unknown outcome, a later permanent refusal (before the server
  looked at the key) gives ``NEEDS_RECONCILE``, never ``DEAD``: single and batch paths.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from orbit_client import OrbitClient
from outbox_adapter import InvalidStateError, Outbox, OutboxTables, enqueue
from outbox_adapter._db import db_now
from outbox_adapter.cli import main
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import (
    run_fault_proxy,
    submission_count,
    task_count,
    tasks_in_creation_order,
    wait_until,
)
from tests.servers import RunningServer


def _enqueue(biz: Biz, tables: OutboxTables, ns: Namespace, n: int = 1, **kwargs: Any) -> list[int]:
    with biz.engine.begin() as conn:
        return [
            enqueue(conn, tables=tables, **{"namespace": ns.name, "queue": "default", "handler": "orders.fulfil",
                                            "params": {"i": i}, **kwargs}).id
            for i in range(n)
        ]  # fmt: skip


def _expire_leases(biz: Biz, tables: OutboxTables) -> None:
    with biz.engine.begin() as conn:
        now = db_now(conn)
        conn.execute(sa.update(tables.outbox).values(available_at=now, lease_expires_at=now))


# --- on_delivered: a database error in the hook --------------------------------------------------------


@pytest.mark.parametrize("swallowed", [False, True], ids=["raised", "caught-by-the-hook"])
def test_a_database_error_in_on_delivered_leaves_only_its_row_to_its_lease(
    biz: Biz, tables: OutboxTables, ns: Namespace, make_relay: RelayFactory, swallowed: bool
) -> None:
    links = sa.Table(f"{tables.name}_links", sa.MetaData(), sa.Column("ref", sa.String(40), primary_key=True))
    links.create(biz.engine)
    try:
        ids = _enqueue(biz, tables, ns, 3)
        with biz.engine.begin() as conn:
            conn.execute(links.insert().values(ref=f"row-{ids[1]}"))  # row 2's link exists: its insert fails
        broken = {ids[1]}

        def link(conn: sa.Connection, row: Any) -> None:
            if row.row_id not in broken:
                conn.execute(links.insert().values(ref=f"row-{row.row_id}"))
                return
            try:
                conn.execute(links.insert().values(ref=f"row-{row.row_id}"))
            except sa.exc.IntegrityError:
                if not swallowed:
                    raise
                # Caught: on PostgreSQL the transaction is now unusable (only a savepoint saves the batch).

        stats = make_relay(batch_size=10, on_delivered=link).run_once()  # does not raise
        outbox = Outbox(biz.engine, tables=tables)
        if swallowed and biz.kind != "postgres":  # the hook chose to ignore it; nothing is broken
            assert stats.delivered == 3
            return
        assert stats.delivered == 2
        rows = [outbox.get(i) for i in ids]
        assert [r.state for r in rows] == ["DELIVERED", "PENDING", "DELIVERED"]
        assert rows[1].lease_token is not None and rows[1].orbit_task_id is None  # left to its lease
        assert [len(outbox.events(i)) for i in ids] == [1, 0, 1]
        with biz.engine.connect() as conn:
            assert sorted(conn.scalars(sa.select(links.c.ref))) == sorted(f"row-{i}" for i in ids)

        broken.clear()  # the hook is fixed; the lease expires; the row is resent and the server replays
        with biz.engine.begin() as conn:
            conn.execute(links.delete().where(links.c.ref == f"row-{ids[1]}"))
        _expire_leases(biz, tables)
        again = make_relay(on_delivered=link).run_once()
        assert (again.delivered, again.replayed) == (1, 1)
        assert outbox.get(ids[1]).state == "DELIVERED"
    finally:
        links.drop(biz.engine)


# --- once unknown, never DEAD ------------------------------------------------------------------------------


def _refusal(status: int, code: str) -> dict[str, Any]:
    return {
        "title": "refused",
        "status": status,
        "code": code,
        "detail": "refused before the key was looked at",
    }


@pytest.mark.parametrize("path", ["batch", "single"])
def test_a_refusal_after_an_unknown_outcome_needs_reconcile_never_dead(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory, path: str
) -> None:
    [row_id] = _enqueue(biz, tables, ns)
    outbox = Outbox(biz.engine, tables=tables)
    key = outbox.get(row_id).idempotency_key
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        if path == "single":  # an older server: no batch route, rows go one by one
            proxy.add("respond", path_contains="/tasks/batch", status=404, body=_refusal(404, "not_found"))
        # First send: the server accepts, the answer never comes (outcome unknown; the task exists).
        proxy.add("forward_then_drop", key=key, times=1)
        # Next send: refused before the key is looked at (a stricter body limit after an upgrade).
        proxy.add("respond", key=key, times=1, status=413, body=_refusal(413, "payload_too_large"))
        # 2 s: the dropped answer must time out, and the relay's other calls (its queue check) must not; with
        # 0.5 s a loaded machine timed the queue check out, the run stopped before the second send (CI, once).
        stats = make_relay(base_url=url, timeout=2.0).run_once()
    assert (stats.retried, stats.dead, stats.needs_reconcile) == (1, 0, 1)
    row = outbox.get(row_id)
    assert row.state == "NEEDS_RECONCILE" and row.last_status_code == 413
    assert "unknown outcome" in (row.last_error or "") and "reconcile" in (row.last_error or "")
    assert submission_count(orbit, key) == 1 and task_count(orbit, ns.name) == 1
    with OrbitClient(orbit.base_url, api_key=ns.keys["read"]) as client:
        [decision] = outbox.reconcile(client, actor="test")
    assert (decision.decision, decision.applied) == ("delivered", True)
    assert outbox.get(row_id).state == "DELIVERED"


# --- ordering keys: commit order --------------------------------------------------------------------------


def _waits_for_a_lock(biz: Biz, session_id: int) -> bool:
    """Whether the session ``session_id`` is waiting for a row lock (read from the server itself)."""
    with biz.engine.connect() as conn:
        if biz.kind == "postgres":
            sql = "SELECT count(*) FROM pg_stat_activity WHERE pid = :id AND wait_event_type = 'Lock'"
        else:
            sql = "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = :id AND trx_state = 'LOCK WAIT'"
        return bool(conn.scalar(sa.text(sql), {"id": session_id}))


def test_one_keys_rows_are_sent_in_commit_order_not_id_order(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    if biz.kind == "sqlite":
        pytest.skip(
            "SQLite has one writer: T2 cannot insert while T1 is open, so the interleaving cannot happen"
        )
    enqueue_k = {"namespace": ns.name, "queue": "default", "handler": "h", "ordering_key": "customer-7",
                 "tables": tables}  # fmt: skip
    relay = make_relay()
    with biz.engine.connect() as t1, biz.engine.connect() as t2:
        t2_id = int(
            t2.scalar(
                sa.text("SELECT pg_backend_pid()" if biz.kind == "postgres" else "SELECT CONNECTION_ID()")
            )
        )
        t2.rollback()  # end the autobegun read
        t1.begin()
        first = enqueue(t1, params={"n": 1}, **enqueue_k)  # T1 stays open
        done = threading.Event()
        second: list[Any] = []

        def t2_enqueues_and_commits() -> None:
            with t2.begin():
                second.append(enqueue(t2, params={"n": 2}, **enqueue_k))
            done.set()

        thread = threading.Thread(target=t2_enqueues_and_commits)
        thread.start()
        wait_until(lambda: done.is_set() or _waits_for_a_lock(biz, t2_id))
        assert not done.is_set()  # T2 waits for T1: enqueues of one key are serialised
        assert relay.run_once().claimed == 0  # nothing committed yet: nothing to send
        t1.commit()
        thread.join(30)
        assert done.is_set()
    outbox = Outbox(biz.engine, tables=tables)
    rows = [outbox.get(first.id), outbox.get(second[0].id)]
    assert [r.ordering_seq for r in rows] == [1, 2]
    stats = relay.run_once()
    assert stats.delivered == 2 and {r.state for r in outbox.list_rows()} == {"DELIVERED"}
    assert [t["params"]["n"] for t in tasks_in_creation_order(orbit, ns.name)] == [1, 2]


def test_rows_without_an_ordering_key_take_no_lock(biz: Biz, tables: OutboxTables, ns: Namespace) -> None:
    if biz.kind == "sqlite":
        pytest.skip("SQLite has one writer: every write transaction waits for the open one")
    plain = {"namespace": ns.name, "queue": "default", "handler": "h", "params": {}, "tables": tables}
    with biz.engine.connect() as t1, biz.engine.connect() as t2:
        t1.begin()
        enqueue(t1, **plain)
        with t2.begin():  # does not wait for T1
            row = enqueue(t2, **plain)
        t1.rollback()
    assert Outbox(biz.engine, tables=tables).get(row.id).ordering_seq is None
    with biz.engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(tables.keys)) == 0


def test_a_rolled_back_enqueue_gives_its_number_back(biz: Biz, tables: OutboxTables, ns: Namespace) -> None:
    keyed = {"namespace": ns.name, "queue": "default", "handler": "h", "params": {}, "ordering_key": "k",
             "tables": tables}  # fmt: skip
    with biz.engine.begin() as conn:
        enqueue(conn, **keyed)
    with biz.engine.connect() as conn:
        conn.begin()
        enqueue(conn, **keyed)
        conn.rollback()
    with biz.engine.begin() as conn:
        row = enqueue(conn, **keyed)
    assert Outbox(biz.engine, tables=tables).get(row.id).ordering_seq == 2


# --- a DEAD head row: status names it, abandon releases the key ------------------------------------------------


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_a_dead_head_row_is_named_by_status_and_abandon_releases_its_key(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [dead] = _enqueue(biz, tables, ns, queue="nope", ordering_key="c1")
    behind = _enqueue(biz, tables, ns, 2, ordering_key="c1")
    assert make_relay().run_once().dead == 1
    outbox = Outbox(biz.engine, tables=tables)
    db = ["--database-url", biz.url.render_as_string(hide_password=False), "--table", tables.name]

    status = _cli("status", *db, "--json")
    assert status.exit_code == 0, status.output
    [blocked] = json.loads(status.stdout)["blocked_keys"]
    assert (blocked["ordering_key"], blocked["row_id"], blocked["state"], blocked["waiting"]) == (
        "c1",
        dead,
        "DEAD",
        2,
    )
    table = _cli("status", *db)
    # Piped: the blocked keys are tab-separated lines under their header line (no title), then the ways out.
    assert f"ordering key\tblocked by row\tstate\twaiting\tlast error\nc1\t{dead}\tDEAD\t2\t" in table.stdout
    assert f"orbit-outbox abandon {dead}" in table.stdout

    abandoned = _cli("abandon", *db, str(dead), "--reason", "queue retired", "--actor", "ops:eve", "--json")
    assert abandoned.exit_code == 0, abandoned.output
    assert json.loads(abandoned.stdout)["state"] == "ABANDONED"
    event = outbox.events(dead)[-1]
    assert (event.from_state, event.to_state, event.actor) == ("DEAD", "ABANDONED", "ops:eve")
    assert "queue retired" in event.reason and "ordering key 'c1' released" in event.reason
    assert json.loads(_cli("status", *db, "--json").stdout)["blocked_keys"] == []

    assert make_relay().run_once().delivered == 2  # the key's later rows go out, in order
    assert [outbox.get(i).state for i in behind] == ["DELIVERED", "DELIVERED"]
    assert [t["params"]["i"] for t in tasks_in_creation_order(orbit, ns.name)] == [0, 1]
    assert outbox.status().counts["ABANDONED"] == 1
    with pytest.raises(InvalidStateError, match="never sent"):
        outbox.retry(dead, actor="t")  # terminal: retry cannot send an abandoned row
    again = _cli("abandon", *db, str(dead), "--reason", "again")
    assert again.exit_code == 1 and f"row {dead} is ABANDONED" in again.stderr


def test_the_migration_numbers_existing_keyed_rows_by_id_and_marks_abandoned_rows(biz: Biz) -> None:
    from outbox_adapter import _migrate

    tables = OutboxTables(name=f"ob_{uuid.uuid4().hex[:10]}")
    _migrate.upgrade(biz.engine, tables=tables, revision="outbox_0002")
    old = sa.table(tables.name, *(sa.column(c) for c in (
        "idempotency_key", "namespace", "queue", "handler", "ordering_key", "state", "attempts", "send_count",
        "available_at", "created_at", "updated_at", "last_error",
    )))  # fmt: skip
    with biz.engine.begin() as conn:
        now = db_now(conn)
        for n, (key, state, error) in enumerate(
            [("a", "DELIVERED", None), ("b", "PENDING", None), ("a", "PENDING", None), (None, "PENDING", None),
             ("b", "DEAD", "abandoned by operator: cancelled"), ("a", "DEAD", "400 validation_error")]
        ):  # fmt: skip
            conn.execute(old.insert().values(idempotency_key=f"k{n}", namespace="ns", queue="q", handler="h",
                                             ordering_key=key, state=state, attempts=0, send_count=0,
                                             available_at=now, created_at=now, updated_at=now, last_error=error))  # fmt: skip
    assert Outbox(biz.engine, tables=tables).migrate() == "outbox_0005"  # the head
    rows = Outbox(biz.engine, tables=tables).list_rows()
    # outbox_0005: every existing row is a task row.
    assert {(r.kind, r.flow) for r in rows} == {("task", None)}
    assert [(r.ordering_key, r.ordering_seq, r.state) for r in rows] == [
        ("a", 1, "DELIVERED"), ("b", 1, "PENDING"), ("a", 2, "PENDING"), (None, None, "PENDING"),
        ("b", 2, "ABANDONED"), ("a", 3, "DEAD"),
    ]  # fmt: skip
    with biz.engine.begin() as conn:  # the next enqueue of a key continues its numbering
        assert enqueue(
            conn, namespace="ns", queue="q", handler="h", params={}, ordering_key="a", tables=tables
        )
    assert Outbox(biz.engine, tables=tables).list_rows()[-1].ordering_seq == 4
