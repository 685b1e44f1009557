"""The ``django.tasks`` backend (``OrbitBackend``, with the ``django-tasks`` backport here): tasks
enqueued through the outbox in Django's transaction, run by Orbit workers (in-process and the
``orbit_worker`` command as a real process), results read back through ``get_result``; on SQLite,
MariaDB and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from orbit_client import OrbitClient, Worker
from tests.integration.django.conftest import Project
from tests.outbox_support import wait_until

ROOT = Path(__file__).resolve().parents[3]


@contextmanager
def worker(project: Project, queue: str = "default") -> Iterator[None]:
    """An Orbit worker in this process running every Orbit-backed task (``orbit_worker``'s handlers)."""
    from outbox_adapter.django._tasks_api import task_backends
    from outbox_adapter.django.backend import OrbitBackend
    from outbox_adapter.django.management.commands.orbit_worker import handler_for

    backend = task_backends["default"]
    handlers = {path: handler_for(task, backend) for path, task in OrbitBackend.registry.items()}
    with OrbitClient(project.orbit.base_url, api_key=project.keys["work"]) as client:
        w = Worker(client, project.namespace, queue, handlers, lease_seconds=5, poll_wait_seconds=0.2,
                   install_signal_handlers=False)  # fmt: skip
        thread = threading.Thread(target=w.run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            w.stop()
            thread.join(timeout=30)


def _finished(result: Any) -> bool:
    result.refresh()
    return bool(result.is_finished)


def test_enqueue_rolled_back_with_the_block_leaves_nothing(django_project: Project, alias: str) -> None:
    from django.db import transaction
    from django_tasks.exceptions import TaskResultDoesNotExist

    from tests.django_project.shop.models import Order
    from tests.django_project.shop.tasks import fulfil

    ref = f"rb-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ZeroDivisionError), transaction.atomic(using=alias):
        Order.objects.using(alias).create(reference=ref)
        result = fulfil.using(backend=alias).enqueue(ref)
        1 / 0  # noqa: B018
    with pytest.raises(TaskResultDoesNotExist):
        fulfil.using(backend=alias).get_result(result.id)
    assert django_project.deliver(alias) == 0


def test_a_committed_task_runs_once_and_its_result_comes_back(django_project: Project, alias: str) -> None:
    from django.db import transaction
    from django_tasks import TaskResultStatus

    from tests.django_project.shop.models import Order
    from tests.django_project.shop.tasks import fulfil

    ref = f"ok-{uuid.uuid4().hex[:8]}"
    task = fulfil.using(backend=alias)
    with transaction.atomic(using=alias):
        order = Order.objects.using(alias).create(reference=ref)
        result = task.enqueue(ref, note="gift", using=alias)
    assert result.status == TaskResultStatus.READY and result.args == [ref]
    assert result.kwargs == {"note": "gift", "using": alias}
    uuid.UUID(result.id)  # the outbox row's idempotency key, stable from enqueue on

    unsent = task.get_result(result.id)  # from the outbox row
    assert unsent.status == TaskResultStatus.READY and unsent.orbit.outbox_state == "PENDING"
    assert unsent.enqueued_at is not None and unsent.enqueued_at.tzinfo is not None
    assert django_project.deliver(alias) == 1
    sent = task.get_result(result.id)  # from Orbit now
    assert sent.id == result.id and sent.status == TaskResultStatus.READY
    assert sent.orbit.orbit_status == "WAITING" and sent.orbit.orbit_task_id

    with worker(django_project):
        wait_until(lambda: _finished(result))
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"reference": ref, "updated": 1, "note": "gift"}
    assert result.attempts == 1 and result.started_at and result.finished_at and not result.errors
    assert result.orbit.orbit_status == "SUCCEEDED"
    order.refresh_from_db()
    assert order.status == "FULFILLED"  # through the ORM, on the order's own database
    assert django_project.deliver(alias) == 0  # delivered once, run once


def test_failures_map_to_failed_with_the_exception_and_retryable_ones_are_retried(
    django_project: Project,
) -> None:
    from django_tasks import TaskResultStatus

    from tests.django_project.shop.tasks import decline, flaky

    failed = decline.enqueue("o-1")
    marker = Path(django_project.orbit.engine.url.database or "").with_name(f"flaky-{uuid.uuid4().hex[:6]}")
    retried = flaky.enqueue(str(marker))
    django_project.deliver("default")
    with worker(django_project):
        wait_until(lambda: _finished(failed) and _finished(retried))
    assert failed.status == TaskResultStatus.FAILED and failed.orbit.orbit_status == "FAILED"
    [error] = failed.errors
    assert error.exception_class_path == "tests.django_project.shop.tasks.PaymentDeclined"
    assert "card declined for o-1" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        _ = failed.return_value
    assert retried.status == TaskResultStatus.SUCCESSFUL and retried.return_value == "second time lucky"
    assert retried.attempts == 2 and [e.exception_class_path for e in retried.errors] == [
        "orbit_client.RetryableError"
    ]


def test_context_and_async_tasks_run_and_the_signals_are_sent(django_project: Project) -> None:
    from django_tasks.signals import task_enqueued, task_finished, task_started

    from tests.django_project.shop.tasks import double, with_context

    seen: list[tuple[str, str, str]] = []
    names = {task_enqueued: "enqueued", task_started: "started", task_finished: "finished"}

    def record(sender: Any, signal: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append((names[signal], task_result.task.name, task_result.status.value))

    for sig, name in names.items():
        sig.connect(record, weak=False, dispatch_uid=f"t-{name}")
    try:
        ctx = with_context.enqueue(7)
        doubled = double.enqueue(21)
        django_project.deliver("default")
        with worker(django_project):
            wait_until(lambda: _finished(ctx) and _finished(doubled))
    finally:
        for sig, name in names.items():
            sig.disconnect(dispatch_uid=f"t-{name}")
    assert ctx.return_value["value"] == 7 and ctx.return_value["attempt"] == 1
    assert doubled.return_value == 42
    assert sorted(seen) == sorted([
        ("enqueued", "with_context", "READY"), ("enqueued", "double", "READY"),
        ("started", "with_context", "RUNNING"), ("started", "double", "RUNNING"),
        ("finished", "with_context", "SUCCESSFUL"), ("finished", "double", "SUCCESSFUL"),
    ])  # fmt: skip


def test_run_after_becomes_orbits_available_at(django_project: Project) -> None:
    from tests.django_project.shop.tasks import fulfil

    later = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    result = fulfil.using(run_after=later).enqueue("later")
    django_project.deliver("default")
    fresh = fulfil.get_result(result.id)
    assert fresh.orbit.task is not None and fresh.orbit.task.available_at == later
    assert fresh.status.value == "READY"


def test_a_row_the_relay_cannot_deliver_is_failed_with_its_reason(django_project: Project) -> None:
    from django_tasks import TaskResultStatus

    from tests.django_project.shop.tasks import fulfil

    result = fulfil.using(queue_name="nowhere").enqueue("lost")
    django_project.deliver("default")
    fresh = fulfil.get_result(result.id)
    assert fresh.status == TaskResultStatus.FAILED and fresh.orbit.outbox_state == "DEAD"
    assert "nowhere" in (fresh.orbit.last_error or "") and fresh.errors


def test_the_api_contract_for_what_orbit_does_not_do(django_project: Project) -> None:
    """Unsupported options are refused as the backport documents (``InvalidTaskError``), nothing written."""
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist, TaskResultMismatch

    from outbox_adapter.django.backend import OrbitBackend
    from tests.django_project.shop.tasks import decline, fulfil

    assert (OrbitBackend.supports_defer, OrbitBackend.supports_get_result) == (True, True)
    assert (OrbitBackend.supports_async_task, OrbitBackend.supports_priority) == (True, True)
    with pytest.raises(InvalidTaskError, match="priority"):
        fulfil.using(priority=101)
    with pytest.raises(InvalidTaskError, match="Queue 'unknown'"):
        fulfil.using(queue_name="unknown")
    with pytest.raises(InvalidTaskError, match="aware"):
        fulfil.using(run_after=datetime(2030, 1, 1))
    before = django_project.deliver("default")
    with pytest.raises(InvalidTaskError, match="JSON"):
        fulfil.enqueue(datetime.now(UTC))
    with pytest.raises(InvalidTaskError, match="bytes of JSON"):
        fulfil.enqueue("x" * 70_000)
    assert before == 0 and django_project.deliver("default") == 0
    with pytest.raises(TaskResultDoesNotExist):
        fulfil.get_result(str(uuid.uuid4()))
    other = fulfil.enqueue("mismatch")
    with pytest.raises(TaskResultMismatch):
        decline.get_result(other.id)
    django_project.deliver("default")


def test_a_tasks_priority_is_the_orbit_tasks(django_project: Project, alias: str) -> None:
    """``Task.priority`` (-100..100, higher first, as in ``django.tasks``) rides the outbox row to Orbit,
    whose leases grant the highest first (tests/integration/test_priority.py)."""
    from django.core.exceptions import ImproperlyConfigured

    from outbox_adapter.django.backend import OrbitBackend
    from tests.django_project.shop.tasks import fulfil

    ref = uuid.uuid4().hex[:8]
    results = {p: fulfil.using(backend=alias, priority=p).enqueue(f"{ref}-{p}") for p in (0, -100, 100, 7)}
    assert django_project.deliver(alias) == 4
    with OrbitClient(django_project.orbit.base_url, api_key=django_project.keys["admin"]) as client:
        found = {p: client.find_submission(django_project.namespace, r.id) for p, r in results.items()}
        for task in found.values():  # not for the workers of later tests
            assert task is not None
            client.cancel_task(django_project.namespace, task.id, reason="test done")
    assert {p: t.priority for p, t in found.items() if t is not None} == {0: 0, -100: -100, 100: 100, 7: 7}
    with pytest.raises(ImproperlyConfigured, match="priority"):
        OrbitBackend("x", {"OPTIONS": {"NAMESPACE": "n", "SUBMIT_OPTIONS": {"priority": 5}}})


async def test_aenqueue_and_aget_result(django_project: Project) -> None:
    from tests.django_project.shop.tasks import fulfil

    result = await fulfil.aenqueue("async")
    fresh = await fulfil.aget_result(result.id)
    assert fresh.id == result.id and fresh.orbit.outbox_state == "PENDING"
    django_project.deliver("default")


def _manage(project: Project, *args: str, **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, **project.env}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.django_project.manage", *args], cwd=ROOT, env=env, text=True, **popen
    )


def test_orbit_worker_command_runs_tasks_and_a_kill_mid_task_is_left_for_review(
    django_project: Project, tmp_path: Path
) -> None:
    """The worker as a real process: it runs a task to success; killed (SIGKILL) in the middle of
    another, the attempt's lease lapses and Orbit holds the task for review (it may have done its
    work): ``get_result`` says ``RUNNING`` (unfinished) and ``orbit.orbit_status`` ``NEEDS_REVIEW``."""
    from django_tasks import TaskResultStatus

    from tests.django_project.shop.tasks import fulfil, hang

    done = fulfil.enqueue("by-process")
    started = tmp_path / "started"
    hung = hang.enqueue(str(started))
    django_project.deliver("default")
    # A 3 s lease: the task that succeeds must keep its lease from grant to report (with 1 s, a worker process
    # stalled 0.7 s by a loaded machine would lose it, and it would go to review); the kill then leaves the other's
    # to lapse.
    proc = _manage(django_project, "orbit_worker", "--queue", "default", "--concurrency", "2",
                   "--lease-seconds", "3", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: _finished(done) and started.exists(), timeout=60)
        assert done.status == TaskResultStatus.SUCCESSFUL
        assert hung.refresh() is None and hung.status == TaskResultStatus.RUNNING
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        wait_until(lambda: (hung.refresh(), hung.orbit.orbit_status)[1] == "NEEDS_REVIEW", timeout=60)
        assert hung.status == TaskResultStatus.RUNNING and not hung.is_finished
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=30)[0]
    assert "orbit_worker: namespace" in out


def test_orbit_outbox_command_migrates_and_relays_the_django_database(
    django_project: Project, tmp_path: Path
) -> None:
    from tests.django_project.shop.tasks import fulfil

    result = fulfil.enqueue("relayed-by-command")
    relay = _manage(django_project, "orbit_outbox", "--database", "default", "relay", "--once",
                    "--api-key", django_project.keys["submit"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    out = relay.communicate(timeout=120)[0]
    assert relay.returncode == 0, out
    assert fulfil.get_result(result.id).orbit.outbox_state == "DELIVERED"
    migrate = _manage(
        django_project, "orbit_outbox", "migrate", stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out = migrate.communicate(timeout=120)[0]
    assert migrate.returncode == 0, out
    bad = _manage(django_project, "orbit_outbox", "--database", "nope", "status", stderr=subprocess.PIPE)
    err = bad.communicate(timeout=120)[1]
    assert bad.returncode == 2 and "--database: 'nope' is not a database alias" in err
