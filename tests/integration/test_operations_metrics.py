"""The server's operational metrics (sampled task and delivery gauges, lease grants and expiries)
and a worker's ``metrics_port``, scraped over HTTP from a real server and a running worker
(README "Operations")."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest

from orbit_client import OrbitClient, OrbitUsageError, RetryableError, TaskContext, Worker
from orbit_client import _metrics as worker_metrics
from orbit_server.db.engine import db_now
from orbit_server.db.schema import task_attempts
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(
        make_database(request.param), sweep_interval_seconds=0.1, metrics_sample_interval_seconds=0.25
    ) as running:
        yield running


def _value(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _scrape_until(url: str, ready: Callable[[str], bool], timeout: float = 20.0) -> str:
    """Scrape until ``ready(text)``: the gauges are sampled on their own clock, there is no event."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url, timeout=5).text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def _namespace(server: RunningServer) -> tuple[str, str, dict[str, str]]:
    ns, queue = f"ns-{uuid.uuid4().hex[:8]}", f"q-{uuid.uuid4().hex[:8]}"
    return ns, queue, server.add_namespace(ns, (queue,))


def test_server_samples_live_tasks_the_review_and_delivery_backlogs_and_counts_grants_and_expiries(
    server: RunningServer,
) -> None:
    ns, queue, keys = _namespace(server)
    url = f"{server.base_url}/metrics"
    expired_before = _value(httpx.get(url).text, 'orbit_lease_expiries_total{attempt_status="RUNNING"}') or 0
    with OrbitClient(server.base_url, api_key=keys["admin"]) as admin:
        sub = f"sub-{uuid.uuid4().hex[:6]}"
        admin.create_subscription(ns, sub)
        for i in range(3):
            admin.submit_task(ns, queue, "h", {"i": i}, idempotency_key=str(uuid.uuid4()))
        text = _scrape_until(
            url, lambda t: _value(t, f'orbit_tasks{{queue="{queue}",status="WAITING"}}') == 3
        )
        assert _value(text, f'orbit_tasks{{queue="{queue}",status="WAITING"}}') == 3
        assert _value(text, f'orbit_tasks{{queue="{queue}",status="RUNNING"}}') == 0
        # One task runs, then its lease lapses while running: not retry-safe, so NEEDS_REVIEW (and an
        # unacked result event for the subscription).
        [grant] = admin.lease_tasks(ns, queue, worker_id="w", max_tasks=1)
        admin.start_attempt(ns, grant.attempt.id, grant.attempt.lease_token)
        with server.engine.begin() as conn:
            conn.execute(
                task_attempts.update()
                .where(task_attempts.c.id == grant.attempt.id)
                .values(lease_expires_at=db_now(conn) - timedelta(seconds=1))
            )
        text = _scrape_until(
            url,
            lambda t: (
                _value(t, f'orbit_tasks{{queue="{queue}",status="NEEDS_REVIEW"}}') == 1
                and _value(t, f'orbit_result_deliveries_unacked{{subscription="{sub}"}}') == 1
            ),
        )
    assert _value(text, f'orbit_tasks{{queue="{queue}",status="NEEDS_REVIEW"}}') == 1
    assert _value(text, f'orbit_tasks{{queue="{queue}",status="WAITING"}}') == 2
    assert (_value(text, "orbit_review_backlog_tasks") or 0) >= 1
    assert (_value(text, "orbit_review_backlog_oldest_age_seconds") or -1) >= 0
    assert _value(text, f'orbit_result_deliveries_unacked{{subscription="{sub}"}}') == 1
    assert (
        _value(text, f'orbit_result_delivery_oldest_unacked_age_seconds{{subscription="{sub}"}}') or -1
    ) >= 0
    assert _value(text, f'orbit_lease_grants_total{{queue="{queue}"}}') == 1
    assert _value(text, 'orbit_lease_expiries_total{attempt_status="RUNNING"}') == expired_before + 1
    assert (_value(text, "orbit_metrics_sampled_timestamp_seconds") or 0) > 0
    assert ns not in text and grant.task.id not in text  # no namespace, task id or key in any label


def test_a_worker_serves_its_counters_and_handler_durations_while_it_runs(server: RunningServer) -> None:
    ns, queue, keys = _namespace(server)

    def ok(ctx: TaskContext) -> Any:
        return {"ok": True}

    def flaky(ctx: TaskContext) -> Any:
        if ctx.generation == 1:
            raise RetryableError("try again")
        return {"generation": ctx.generation}

    def broken(ctx: TaskContext) -> Any:
        raise ValueError("no")

    with OrbitClient(server.base_url, api_key=keys["admin"]) as admin:
        for handler, options in (("ok", {}), ("flaky", {"backoff_base_seconds": 0}), ("broken", {})):
            admin.submit_task(ns, queue, handler, {}, idempotency_key=str(uuid.uuid4()), options=options)
    handlers = {"ok": ok, "flaky": flaky, "broken": broken}
    with OrbitClient(server.base_url, api_key=keys["work"]) as client:
        worker = Worker(client, ns, queue, handlers, concurrency=2, poll_wait_seconds=0.2,
                        install_signal_handlers=False, metrics_port=0)  # fmt: skip
        runner = threading.Thread(target=worker.run)
        runner.start()
        labels = f'namespace="{ns}",queue="{queue}"'
        try:
            deadline = time.monotonic() + 20
            while worker.metrics_port == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
            text = _scrape_until(
                url,
                lambda t: (
                    _value(t, f"orbit_worker_tasks_succeeded_total{{{labels}}}") == 2
                    and _value(t, f"orbit_worker_tasks_failed_total{{{labels}}}") == 1
                ),
            )
        finally:
            worker.stop()
            runner.join(timeout=30)
    assert _value(text, f"orbit_worker_tasks_leased_total{{{labels}}}") == 4
    assert _value(text, f"orbit_worker_tasks_succeeded_total{{{labels}}}") == 2
    assert _value(text, f"orbit_worker_tasks_retried_total{{{labels}}}") == 1
    assert _value(text, f"orbit_worker_tasks_failed_total{{{labels}}}") == 1
    assert _value(text, f"orbit_worker_lease_lost_total{{{labels}}}") == 0
    assert _value(text, f"orbit_worker_heartbeat_failures_total{{{labels}}}") == 0
    assert _value(text, f'orbit_worker_handler_duration_seconds_count{{handler="flaky",{labels}}}') == 2
    with pytest.raises(httpx.TransportError):  # the last worker on the port stopped: the port is free
        httpx.get(url, timeout=2)


def test_a_worker_metrics_port_without_prometheus_client_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_metrics, "_families", None)
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)  # as if not installed
    with (
        OrbitClient("http://127.0.0.1:1", api_key="k") as client,
        pytest.raises(OrbitUsageError, match=r"pip install 'orbit\[metrics\]'"),
    ):
        Worker(client, "ns", "q", {"h": lambda ctx: None}, metrics_port=9100)
