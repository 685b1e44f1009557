"""The relay's and the result consumer's Prometheus metrics, scraped over HTTP while they run
(README "Operations"); the backlog sample on each business database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient
from outbox_adapter import Outbox, OutboxTables, OutboxUsageError, RelayMetrics, ResultConsumer, enqueue
from outbox_adapter._metrics import sample_backlog
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.servers import RunningServer

#: The HTTP side needs one business database; the backlog sample runs on each of them.
SQLITE_ONLY = pytest.mark.parametrize("biz", ["sqlite"], indirect=True)


def _enqueue(biz: Biz, tables: OutboxTables, ns: Namespace, n: int, queue: str = "default") -> list[int]:
    with biz.engine.begin() as conn:
        return [
            enqueue(conn, tables=tables, namespace=ns.name, queue=queue, handler="h", params={"i": i}).id
            for i in range(n)
        ]


def _value(text: str, sample: str) -> float | None:
    """The value of one sample line (``name`` or ``name{labels}``) in a scrape, or ``None``."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _scrape_until(url: str, ready: Callable[[str], bool], timeout: float = 20.0) -> str:
    """Scrape ``url`` until ``ready(text)``: a sample is taken on its own clock, there is no event."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url, timeout=5).text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_backlog_sample_counts_rows_per_state_and_the_oldest_pending_age(
    biz: Biz, tables: OutboxTables, ns: Namespace, outbox: Outbox
) -> None:
    with outbox.transaction("sample") as conn:
        assert sample_backlog(conn, tables) == ({"PENDING": 0, "NEEDS_RECONCILE": 0, "DEAD": 0}, None)
    ids = _enqueue(biz, tables, ns, 4)
    o = tables.outbox
    with biz.engine.begin() as conn:
        conn.execute(sa.update(o).where(o.c.id == ids[0]).values(state="DEAD"))
        conn.execute(sa.update(o).where(o.c.id == ids[1]).values(state="NEEDS_RECONCILE"))
    with outbox.transaction("sample") as conn:
        counts, age = sample_backlog(conn, tables)
    assert counts == {"PENDING": 2, "NEEDS_RECONCILE": 1, "DEAD": 1}
    assert age is not None and 0 <= age < 60


@SQLITE_ONLY
def test_relay_serves_its_counters_and_the_sampled_backlog_while_it_runs(
    biz: Biz, tables: OutboxTables, ns: Namespace, make_relay: RelayFactory
) -> None:
    _enqueue(biz, tables, ns, 5)
    _enqueue(biz, tables, ns, 1, queue="missing")  # refused for good: DEAD
    relay = make_relay(metrics_port=0, metrics_sample_interval=0.05)
    runner = threading.Thread(target=relay.run)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while relay.metrics_server is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.metrics_server is not None
        url = relay.metrics_server.url
        text = _scrape_until(
            url,
            lambda t: (
                _value(t, "orbit_relay_rows_delivered_total") == 5
                and _value(t, 'orbit_outbox_rows{state="DEAD"}') == 1
                and _value(t, 'orbit_outbox_rows{state="PENDING"}') == 0
            ),
        )
    finally:
        relay.stop()
        runner.join(timeout=30)
    assert _value(text, "orbit_relay_rows_claimed_total") == 6
    assert _value(text, "orbit_relay_rows_delivered_total") == 5
    assert _value(text, "orbit_relay_rows_dead_total") == 1
    assert _value(text, "orbit_relay_rows_retried_total") == 0
    assert _value(text, "orbit_relay_lease_lost_total") == 0
    assert _value(text, 'orbit_outbox_rows{state="NEEDS_RECONCILE"}') == 0
    assert _value(text, "orbit_outbox_oldest_pending_age_seconds") == 0
    assert (_value(text, "orbit_relay_send_duration_seconds_count") or 0) >= 1
    assert _value(text, "orbit_relay_batch_size_rows_sum") == 6  # every row went in some request
    assert ns.name not in text and "missing" not in text  # no namespace, queue, key or id in a label
    # The port is free again once the relay stopped.
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=2)


@SQLITE_ONLY
def test_a_metrics_port_in_use_is_a_clear_error_before_anything_is_claimed(
    biz: Biz, tables: OutboxTables, ns: Namespace, make_relay: RelayFactory, outbox: Outbox
) -> None:
    [row_id] = _enqueue(biz, tables, ns, 1)
    first = make_relay(metrics_port=0)
    holder = threading.Thread(target=first.run)
    holder.start()
    try:
        deadline = time.monotonic() + 20
        while first.metrics_server is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.metrics_server is not None
        taken = first.metrics_server.port
        with pytest.raises(
            OutboxUsageError, match=f"cannot serve metrics on 127.0.0.1:{taken}.*--metrics-port"
        ):
            make_relay(metrics_port=taken).run()
    finally:
        first.stop()
        holder.join(timeout=30)
    assert outbox.get(row_id).state == "DELIVERED"


@SQLITE_ONLY
def test_metrics_on_the_applications_own_registry_without_a_port(
    biz: Biz, tables: OutboxTables, ns: Namespace, make_relay: RelayFactory
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    _enqueue(biz, tables, ns, 3)
    relay = make_relay(metrics=RelayMetrics(registry))
    assert relay.run_once().delivered == 3 and relay.metrics_server is None
    text = generate_latest(registry).decode()
    assert _value(text, "orbit_relay_rows_delivered_total") == 3
    assert _value(text, 'orbit_outbox_rows{state="PENDING"}') is not None  # sampled at the start of the run


@SQLITE_ONLY
def test_consumer_counts_applied_events_and_their_apply_time_and_serves_them(
    biz: Biz, tables: OutboxTables, orbit: RunningServer, ns: Namespace
) -> None:
    from tests.integration.outbox.test_inbox import finished_task

    with OrbitClient(orbit.base_url, api_key=ns.keys["admin"]) as admin:
        admin.create_subscription(ns.name, "results")
    for _ in range(2):
        finished_task(orbit, ns, succeed=True)
    with OrbitClient(orbit.base_url, api_key=ns.keys["work"]) as client:
        consumer = ResultConsumer(
            biz.engine, client, ns.name, "results", lambda conn, event: None, tables=tables, poll_interval=0.05,
            metrics_port=0,
        )  # fmt: skip
        runner = threading.Thread(target=consumer.run)
        runner.start()
        try:
            deadline = time.monotonic() + 20
            while consumer.metrics_server is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert consumer.metrics_server is not None
            text = _scrape_until(
                consumer.metrics_server.url,
                lambda t: _value(t, 'orbit_consumer_events_applied_total{subscription="results"}') == 2,
            )
        finally:
            consumer.stop()
            runner.join(timeout=30)
            consumer.close()
    assert _value(text, 'orbit_consumer_events_applied_total{subscription="results"}') == 2
    assert _value(text, 'orbit_consumer_apply_duration_seconds_count{subscription="results"}') == 2
