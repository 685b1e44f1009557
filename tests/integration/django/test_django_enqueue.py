"""``outbox_adapter.django.enqueue`` writes the outbox row through Django's connection, in Django's
transaction, on SQLite, MariaDB and PostgreSQL (README "Django"), with a real relay and server:
what ``transaction.atomic()`` rolls back is never sent, what it commits is sent exactly once."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_adapter import (
    OutboxDatabaseError,
    OutboxTables,
    OutboxUsageError,
    ParamsTooLargeError,
)
from outbox_adapter import (
    enqueue as sqlalchemy_enqueue,
)
from tests.integration.django.conftest import Project
from tests.outbox_support import task_count


class Boom(Exception):
    pass


def _rows(project: Project, alias: str, **where: Any) -> list[dict[str, Any]]:
    engine = project.engine(alias)
    o = OutboxTables().outbox
    try:
        with engine.connect() as conn:
            stmt = sa.select(o).order_by(o.c.id)
            for name, value in where.items():
                stmt = stmt.where(o.c[name] == value)
            return [dict(r._mapping) for r in conn.execute(stmt)]
    finally:
        engine.dispose()


def _deliver(project: Project, alias: str) -> int:
    return project.deliver(alias)


def _enqueue(project: Project, alias: str, ref: str, **extra: Any) -> Any:
    from outbox_adapter.django import enqueue

    return enqueue(
        namespace=project.namespace, queue="default", handler="orders.fulfil", params={"ref": ref},
        using=alias, business_ref=ref, **extra,
    )  # fmt: skip


def test_rollback_of_atomic_leaves_no_row_and_the_relay_delivers_nothing(
    django_project: Project, alias: str
) -> None:
    """The issue's failure, on the Django path: the order and its row roll back together."""
    from django.db import transaction

    from tests.django_project.shop.models import Order

    ref = f"r-{uuid.uuid4().hex[:8]}"
    before = task_count(django_project.orbit, django_project.namespace)
    with pytest.raises(Boom), transaction.atomic(using=alias):
        Order.objects.using(alias).create(reference=ref)
        _enqueue(django_project, alias, ref)
        raise Boom
    assert not Order.objects.using(alias).filter(reference=ref).exists()
    assert _rows(django_project, alias, business_ref=ref) == []
    assert _deliver(django_project, alias) == 0
    assert task_count(django_project.orbit, django_project.namespace) == before


def test_commit_of_atomic_is_delivered_exactly_once(django_project: Project, alias: str) -> None:
    from django.db import transaction

    from tests.django_project.shop.models import Order

    ref = f"c-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(reference=ref)
        entry = _enqueue(django_project, alias, ref)
        # Not visible to another connection before the commit: it is part of Django's transaction.
        assert _rows(django_project, alias, business_ref=ref) == []
    before = task_count(django_project.orbit, django_project.namespace)
    assert _deliver(django_project, alias) == 1
    assert _deliver(django_project, alias) == 0
    assert task_count(django_project.orbit, django_project.namespace) == before + 1
    [row] = _rows(django_project, alias, business_ref=ref)
    assert row["id"] == entry.id and row["idempotency_key"] == entry.idempotency_key
    assert row["state"] == "DELIVERED" and row["orbit_task_id"]


def test_a_rolled_back_savepoint_takes_only_its_own_row(django_project: Project, alias: str) -> None:
    """Nested atomic blocks: the row of a rolled-back savepoint is not sent, its siblings are."""
    from django.db import transaction

    tag = uuid.uuid4().hex[:8]
    with transaction.atomic(using=alias):
        _enqueue(django_project, alias, f"a-{tag}")
        with pytest.raises(Boom), transaction.atomic(using=alias):
            _enqueue(django_project, alias, f"b-{tag}")
            raise Boom
        with transaction.atomic(using=alias):
            _enqueue(django_project, alias, f"c-{tag}")
    sent = {
        row["business_ref"]
        for row in _rows(django_project, alias)
        if (row["business_ref"] or "").endswith(tag)
    }
    assert sent == {f"a-{tag}", f"c-{tag}"}
    assert _deliver(django_project, alias) == 2


def test_outside_an_atomic_block_the_row_commits_at_once(django_project: Project, alias: str) -> None:
    """Autocommit, like a model save: another connection sees the row when enqueue returns."""
    ref = f"auto-{uuid.uuid4().hex[:8]}"
    entry = _enqueue(django_project, alias, ref, ordering_key=f"k-{ref}")
    [row] = _rows(django_project, alias, business_ref=ref)
    assert row["id"] == entry.id and row["state"] == "PENDING" and row["ordering_seq"] == 1
    assert _deliver(django_project, alias) == 1


def test_the_row_is_the_one_sqlalchemy_enqueue_writes(django_project: Project, alias: str) -> None:
    """One definition of the row: the same arguments give the same columns through either path."""
    from django.db import transaction

    from outbox_adapter.django import enqueue

    tag = uuid.uuid4().hex[:8]
    arguments: dict[str, Any] = {
        "namespace": django_project.namespace, "queue": "other", "handler": "orders.fulfil",
        "params": {"n": [1, 2.5, "é", None, {"deep": True}]}, "ordering_key": f"k-{tag}",
        "available_at": datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC), "max_attempts": 7,
        "options": {"retry_safe": True, "deadline": datetime(2031, 1, 1, tzinfo=UTC)},
    }  # fmt: skip
    with transaction.atomic(using=alias):
        enqueue(using=alias, idempotency_key=f"dj-{tag}", business_ref=f"dj-{tag}", **arguments)
    engine = django_project.engine(alias)
    with engine.begin() as conn:
        sqlalchemy_enqueue(conn, idempotency_key=f"sa-{tag}", business_ref=f"sa-{tag}", **arguments)
    engine.dispose()
    [dj] = _rows(django_project, alias, business_ref=f"dj-{tag}")
    [sa_row] = _rows(django_project, alias, business_ref=f"sa-{tag}")
    differ = {"id", "idempotency_key", "business_ref", "created_at", "updated_at", "ordering_seq"}
    assert {k: v for k, v in dj.items() if k not in differ} == {
        k: v for k, v in sa_row.items() if k not in differ
    }
    assert (dj["ordering_seq"], sa_row["ordering_seq"]) == (1, 2)  # one key, numbered across both paths
    assert dj["params"] == arguments["params"] and dj["available_at"] == datetime(2030, 1, 2, 3, 4, 5, 678901)


def test_invalid_arguments_are_refused_as_sqlalchemy_enqueue_refuses_them(
    django_project: Project, alias: str
) -> None:
    from outbox_adapter.django import enqueue

    ref = f"bad-{uuid.uuid4().hex[:8]}"
    base: dict[str, Any] = {
        "namespace": django_project.namespace,
        "queue": "default",
        "handler": "h",
        "business_ref": ref,
    }
    with pytest.raises(ParamsTooLargeError):
        enqueue(params={"x": "y" * 70_000}, using=alias, **base)
    with pytest.raises(OutboxUsageError, match="namespace"):
        enqueue(params={}, using=alias, **{**base, "namespace": "bad name"})
    with pytest.raises(OutboxUsageError, match="timezone"):
        enqueue(params={}, using=alias, available_at=datetime(2030, 1, 1), **base)
    with pytest.raises(OutboxUsageError, match="not a database alias"):
        enqueue(params={}, using="nope", **base)
    assert _rows(django_project, alias, business_ref=ref) == []


def test_a_duplicate_key_is_refused_and_marks_the_block_for_rollback(
    django_project: Project, alias: str
) -> None:
    from django.db import transaction

    from tests.django_project.shop.models import Order

    key = f"dup-{uuid.uuid4().hex[:8]}"
    _enqueue(django_project, alias, key, idempotency_key=key)
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(reference=key)
        with pytest.raises(OutboxDatabaseError, match="already exists"), transaction.atomic(using=alias):
            _enqueue(django_project, alias, key, idempotency_key=key)
        # The enqueue's own atomic block rolled back to its savepoint: the order is still there.
    assert Order.objects.using(alias).filter(reference=key).exists()
    assert len(_rows(django_project, alias, idempotency_key=key)) == 1
    _deliver(django_project, alias)


def test_sqlalchemy_enqueue_inside_a_django_atomic_block_is_refused(
    django_project: Project, alias: str
) -> None:
    """The natural mistake of the issue: a second (SQLAlchemy) engine on the same database, called in
    ``transaction.atomic()``. Its row would outlive the rollback; it is refused, nothing written."""
    from django.db import transaction
    from django.test import override_settings

    from tests.django_project.shop.models import Order

    ref = f"mix-{uuid.uuid4().hex[:8]}"
    engine = django_project.engine(alias)
    arguments: dict[str, Any] = {"namespace": django_project.namespace, "queue": "default", "handler": "h",
                                 "params": {}, "business_ref": ref}  # fmt: skip
    try:
        with pytest.raises(Boom), transaction.atomic(using=alias):
            Order.objects.using(alias).create(reference=ref)
            with (
                pytest.raises(OutboxUsageError, match=r"outbox_adapter\.django\.enqueue"),
                engine.begin() as conn,
            ):
                sqlalchemy_enqueue(conn, **arguments)
            raise Boom
        assert _rows(django_project, alias, business_ref=ref) == []
        # Allowed on purpose (another database): then the row indeed outlives the Django rollback,
        # which is exactly the guarantee lost, and why the default refuses.
        allowed = override_settings(ORBIT={"ALLOW_SQLALCHEMY_ENQUEUE_IN_ATOMIC": True})
        with allowed, pytest.raises(Boom), transaction.atomic(using=alias):
            with engine.begin() as conn:
                sqlalchemy_enqueue(conn, **arguments)
            raise Boom
        assert len(_rows(django_project, alias, business_ref=ref)) == 1
        # Outside any atomic block the SQLAlchemy enqueue works as always.
        with engine.begin() as conn:
            sqlalchemy_enqueue(conn, **{**arguments, "business_ref": f"{ref}-free"})
    finally:
        engine.dispose()
        _deliver(django_project, alias)


def test_available_at_and_flows_go_through_the_same_path(django_project: Project, alias: str) -> None:
    from outbox_adapter.django import enqueue_flow

    ref = f"flow-{uuid.uuid4().hex[:8]}"
    later = datetime.now(UTC) + timedelta(hours=1)
    entry = enqueue_flow(namespace=django_project.namespace, flow="order-approval", input={"ref": ref},
                         using=alias, business_ref=ref, available_at=later)  # fmt: skip
    [row] = _rows(django_project, alias, business_ref=ref)
    assert entry.kind == "flow" and row["kind"] == "flow" and row["flow"] == "order-approval"
    assert _deliver(django_project, alias) == 0  # not due for an hour
