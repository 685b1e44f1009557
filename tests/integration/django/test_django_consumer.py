"""Results back through the ORM, once: ``DjangoResultConsumer`` (and ``manage.py orbit_consume``)
applies each result event with a Django handler inside the same ``transaction.atomic()`` as its
inbox row, on SQLite, MariaDB and PostgreSQL, against a real server's subscription."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from orbit_client import OrbitClient, OrbitConnectError
from outbox_adapter import OutboxTables
from tests.integration.django.conftest import Project
from tests.integration.django.test_django_tasks_backend import _finished, _manage, worker
from tests.outbox_support import wait_until


class AckFailsOnce:
    """The client's delivery calls, with the first ack lost (as if the process died after the commit)."""

    def __init__(self, client: OrbitClient) -> None:
        self.client, self.failed = client, False

    def lease_deliveries(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.lease_deliveries(*args, **kwargs)

    def ack_delivery(self, *args: Any, **kwargs: Any) -> None:
        if not self.failed:
            self.failed = True
            raise OrbitConnectError("ack lost on the way", method="POST", url="ack")
        self.client.ack_delivery(*args, **kwargs)


def _inbox(project: Project, alias: str, subscription: str) -> list[dict[str, Any]]:
    engine = project.engine(alias)
    i = OutboxTables().inbox
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(i).where(i.c.subscription == subscription))
            return [dict(r._mapping) for r in rows]
    finally:
        engine.dispose()


def _subscription(project: Project) -> str:
    name = f"sub-{uuid.uuid4().hex[:8]}"
    with OrbitClient(project.orbit.base_url, api_key=project.keys["admin"]) as admin:
        admin.create_subscription(project.namespace, name)
    return name


def test_a_result_is_applied_through_the_orm_once(django_project: Project, alias: str) -> None:
    """A handler failure rolls back its ORM update and the inbox row (the event comes back); a lost
    ack redelivers an event already applied, which changes nothing."""
    from outbox_adapter.django.consumer import DjangoResultConsumer
    from tests.django_project.shop import results
    from tests.django_project.shop.models import Order
    from tests.django_project.shop.tasks import fulfil

    subscription = _subscription(django_project)
    ref = f"res-{uuid.uuid4().hex[:8]}"
    Order.objects.using(alias).create(reference=ref)
    result = fulfil.using(backend=alias).enqueue(ref, using=alias)
    django_project.deliver(alias)
    with worker(django_project):
        wait_until(lambda: _finished(result))

    results.FAIL_ONCE.add(ref)
    handler = getattr(results, f"apply_{alias}")
    with OrbitClient(django_project.orbit.base_url, api_key=django_project.keys["work"]) as client:
        flaky = AckFailsOnce(client)
        with DjangoResultConsumer(flaky, django_project.namespace, subscription, handler, using=alias,
                                  lease_seconds=1, poll_interval=0.05) as consumer:  # fmt: skip
            first = consumer.run_once()
            assert first.failed == 1 and first.applied == 0
            order = Order.objects.using(alias).get(reference=ref)
            assert (order.status, order.completions) == ("FULFILLED", 0)  # rolled back with the inbox row
            assert _inbox(django_project, alias, subscription) == []

            applied = duplicates = 0

            def settled() -> bool:
                nonlocal applied, duplicates
                stats = consumer.run_once()
                applied += stats.applied
                duplicates += stats.duplicates
                return applied == 1 and duplicates == 1

            # Applied (its ack lost), then delivered again after the lease: a duplicate, acked.
            wait_until(settled, timeout=30)
    order.refresh_from_db()
    assert (order.status, order.completions) == ("SUCCEEDED", 1)
    [row] = _inbox(django_project, alias, subscription)
    assert (
        row["outcome"] == "APPLIED"
        and row["processed_at"] is not None
        and row["task_id"] == result.orbit.orbit_task_id
    )


def test_orbit_consume_command(django_project: Project) -> None:
    import subprocess

    from tests.django_project.shop.models import Order
    from tests.django_project.shop.tasks import fulfil

    subscription = _subscription(django_project)
    ref = f"cmd-{uuid.uuid4().hex[:8]}"
    Order.objects.create(reference=ref)
    result = fulfil.enqueue(ref)
    django_project.deliver("default")
    with worker(django_project):
        wait_until(lambda: _finished(result))
    proc = _manage(django_project, "orbit_consume", "--subscription", subscription,
                   "--handler", "tests.django_project.shop.results:apply_default", "--once",
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "1 applied" in out
    assert Order.objects.get(reference=ref).completions == 1
    bad = _manage(django_project, "orbit_consume", "--subscription", subscription, "--handler", "nope",
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    out = bad.communicate(timeout=120)[0]
    assert bad.returncode != 0 and "module:function" in out
