"""Claims do not lean on ``SKIP LOCKED`` (DESIGN §5): with the locking clause turned into a no-op,
as some MySQL-compatible engines do, two relays still never claim the same row, and a row's
attempt is counted once. On SQLite, MariaDB and PostgreSQL business databases."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_adapter import Outbox, OutboxTables, enqueue
from outbox_adapter import _queries as q
from tests.integration.outbox.conftest import Biz

CLAIM = {"lease_seconds": 60.0, "default_max_attempts": 5}


def _rows(biz: Biz, tables: OutboxTables, n: int) -> list[int]:
    with biz.engine.begin() as conn:
        return [
            enqueue(conn, namespace="shop", queue="default", handler="h", params={"i": i}, tables=tables).id
            for i in range(n)
        ]


def test_rows_another_relay_claimed_after_the_select_are_not_claimed_again(
    biz: Biz, tables: OutboxTables
) -> None:
    ids = _rows(biz, tables, 4)
    outbox = Outbox(biz.engine, tables=tables)
    with outbox.transaction("select") as conn:  # relay A's select: it locked nothing
        seen = q.select_due(conn, tables, limit=10)
    assert [r["id"] for r in seen] == ids
    with outbox.transaction("claim") as conn:  # relay B claims two of them meanwhile
        b_claims, _ = q.claim_batch(conn, tables, owner="b", limit=2, actor="relay:b", **CLAIM)
    with outbox.transaction("take") as conn:  # relay A's conditional update, on what it saw
        a_claims, _ = q.take_rows(conn, tables, seen, owner="a", actor="relay:a", **CLAIM)
    assert [c.id for c in b_claims] == ids[:2]
    assert [c.id for c in a_claims] == ids[2:]  # only the rows still free
    rows = outbox.list_rows()
    assert [(r.lease_owner, r.attempts, r.send_count) for r in rows] == [("b", 1, 1)] * 2 + [("a", 1, 1)] * 2
    assert {r.lease_token for r in rows[:2]} == {b_claims[0].token}
    assert {r.lease_token for r in rows[2:]} == {a_claims[0].token}


def test_an_expired_lease_taken_over_after_the_select_is_not_taken_again(
    biz: Biz, tables: OutboxTables
) -> None:
    [row_id] = _rows(biz, tables, 1)
    outbox = Outbox(biz.engine, tables=tables)
    with outbox.transaction("claim") as conn:  # a relay claims with a lease that ends at once, and dies
        q.claim_batch(conn, tables, owner="dead", limit=1, actor="relay:dead", lease_seconds=0.0,
                      default_max_attempts=5)  # fmt: skip
    with outbox.transaction("select") as conn:
        seen = q.select_due(conn, tables, limit=10)
    assert [r["lease_owner"] for r in seen] == ["dead"]
    with outbox.transaction("claim") as conn:  # relay B takes the expired lease over
        [b_claim], _ = q.claim_batch(conn, tables, owner="b", limit=1, actor="relay:b", lease_seconds=0.0,
                                     default_max_attempts=5)  # fmt: skip
    with outbox.transaction("take") as conn:  # still due (lease 0), but no longer the token A saw
        a_claims, _ = q.take_rows(conn, tables, seen, owner="a", actor="relay:a", **CLAIM)
    assert a_claims == []
    row = outbox.get(row_id)
    assert (row.lease_owner, row.lease_token, row.attempts) == ("b", b_claim.token, 2)


@pytest.mark.parametrize("relays", [2, 4])
def test_concurrent_claims_without_the_locking_clause_never_claim_a_row_twice(
    biz: Biz, tables: OutboxTables, monkeypatch: pytest.MonkeyPatch, relays: int
) -> None:
    if biz.kind == "sqlite":
        pytest.skip("SQLite claims under BEGIN IMMEDIATE: one writer, no concurrent selects to interleave")
    ids = _rows(biz, tables, 6)
    monkeypatch.setattr(q, "LOCK_CLAIMS", False)  # FOR UPDATE SKIP LOCKED locks nothing (TiDB)
    all_selected = threading.Barrier(relays, timeout=20)
    select_due = q.select_due

    def select_then_wait(*args: Any, **kwargs: Any) -> list[Any]:
        rows = select_due(*args, **kwargs)
        all_selected.wait()  # every relay has seen every row before any of them updates
        return rows

    monkeypatch.setattr(q, "select_due", select_then_wait)
    outbox = Outbox(biz.engine, tables=tables)
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def relay(name: str) -> None:
        try:
            with outbox.transaction("claim") as conn:
                claims, _ = q.claim_batch(conn, tables, owner=name, limit=10, actor=f"relay:{name}", **CLAIM)
            claimed[name] = [c.id for c in claims]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=relay, args=(f"r{i}",)) for i in range(relays)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    every = [row_id for ids_ in claimed.values() for row_id in ids_]
    assert sorted(every) == ids  # each row claimed by exactly one relay
    rows = outbox.list_rows()
    assert [(r.attempts, r.send_count) for r in rows] == [(1, 1)] * len(ids)  # counted once
    owners = {r.id: r.lease_owner for r in rows}
    assert all(owners[row_id] == name for name, ids_ in claimed.items() for row_id in ids_)
    with biz.engine.connect() as conn:  # and each row carries its claimer's single token
        tokens = conn.execute(sa.select(tables.outbox.c.lease_owner, tables.outbox.c.lease_token)).all()
    assert len({token for _, token in tokens}) == len({owner for owner, _ in tokens})
