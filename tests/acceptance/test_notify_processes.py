"""Wake-ups across server processes on PostgreSQL (``LISTEN/NOTIFY``, issue 32 item 3), with real processes.

Two ``orbit-server serve`` processes on one PostgreSQL database. Server A polls every 30 s
(``ORBIT_LEASE_POLL_INTERVAL_SECONDS``), so a lease call long-polling A that answers within seconds of a
submission through B (or of the release of the concurrency permit it waited for) was woken by B's
notification, not by polling. The listener survives its connection
being terminated, and a burst of submissions sends one notification per interval, not one per submission.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from orbit_server.db.engine import create_engine
from orbit_server.db.pg_notify import CHANNEL, decode
from orbit_server.db.schema import worker_sightings
from tests.conftest import DatabaseFactory
from tests.flow_support import FlowApi
from tests.server_processes import ServerProcess, prepare

pytestmark = pytest.mark.postgres

NS, QUEUE = "wake", "jobs"
#: Server A's poll interval: far longer than any bound below, so only a notification explains an answer.
SLOW_POLL = "30"
#: How soon a woken long poll answers after the submission, in seconds: well under the 20 s it waits and
#: the 30 s poll, and room for a loaded machine (1 s was a few hops of three processes there: a stall of one
#: of them is 1-2 s).
WOKEN_WITHIN = 5.0


@dataclass
class Setup:
    url: URL
    keys: dict[str, str]
    spawn: Callable[..., ServerProcess]
    tmp: Path

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    def submit(self, base_url: str, client: httpx.Client | None = None) -> None:
        post = client.post if client is not None else httpx.post
        answer = post(
            f"{base_url}/v1/namespaces/{NS}/tasks",
            json={"queue": QUEUE, "handler": "noop"},
            headers={**self.headers("submit"), "Idempotency-Key": uuid.uuid4().hex},
            timeout=30,
        )
        assert answer.status_code == 201, answer.text


@pytest.fixture
def setup(
    make_database: DatabaseFactory, server_processes: Callable[..., ServerProcess], tmp_path: Path
) -> Setup:
    url = make_database("postgres")
    return Setup(url, prepare(url, NS, (QUEUE,)), server_processes, tmp_path)


def _pg(url: URL) -> psycopg.Connection:
    return psycopg.connect(url.set(drivername="postgresql").render_as_string(False), autocommit=True)


class LongPoll:
    """A worker's lease call with a long wait on ``base_url``, in a thread; :meth:`waiting` returns once the
    server looked for tasks and found none (its first pass writes the worker's sighting)."""

    def __init__(self, setup: Setup, base_url: str, wait_seconds: float = 20.0) -> None:
        self.worker = f"w-{uuid.uuid4().hex[:8]}"
        self.answered = threading.Event()
        self.grants: list[dict[str, object]] = []
        self.answered_at = 0.0
        self._setup = setup

        def lease() -> None:
            answer = httpx.post(
                f"{base_url}/v1/namespaces/{NS}/queues/{QUEUE}/leases",
                json={"worker_id": self.worker, "wait_seconds": wait_seconds, "lease_seconds": 60},
                headers=setup.headers("work"),
                timeout=wait_seconds + 30,
            )
            assert answer.status_code == 200, answer.text
            self.grants = answer.json()
            self.answered_at = time.monotonic()
            self.answered.set()

        self._thread = threading.Thread(target=lease, daemon=True)
        self._thread.start()

    def waiting(self, timeout: float = 30.0) -> None:
        engine = create_engine(self._setup.url, pool_size=1)
        seen = sa.select(sa.func.count()).where(worker_sightings.c.worker_id == self.worker)
        deadline = time.monotonic() + timeout
        try:
            while True:
                with engine.connect() as conn:
                    if conn.execute(seen).scalar_one():
                        break
                assert not self.answered.is_set(), f"answered before any task was submitted: {self.grants}"
                assert time.monotonic() < deadline, "the lease call never looked for tasks"
                time.sleep(0.02)
        finally:
            engine.dispose()
        assert not self.answered.is_set(), self.grants

    def join(self) -> None:
        self._thread.join(timeout=60)


def _listener_pids(url: URL, role: str = "listener") -> list[int]:
    with _pg(url) as conn:
        return [
            pid
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = %s ORDER BY backend_start",
                (f"orbit-server notify {role}",),
            )
        ]


def _await(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def two_servers(setup: Setup) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    a = setup.spawn(setup.url, setup.tmp / "a.log", ORBIT_LEASE_POLL_INTERVAL_SECONDS=SLOW_POLL)
    b = setup.spawn(setup.url, setup.tmp / "b.log")
    _await(lambda: len(_listener_pids(setup.url)) == 2, "both servers listen")
    yield a, b


def test_a_submission_on_one_server_wakes_a_long_poll_on_the_other(
    setup: Setup, two_servers: tuple[ServerProcess, ServerProcess]
) -> None:
    a, b = two_servers
    poll = LongPoll(setup, a.base_url)
    poll.waiting()
    submitted = time.monotonic()
    setup.submit(b.base_url)
    assert poll.answered.wait(timeout=25)
    poll.join()
    assert len(poll.grants) == 1
    assert poll.answered_at - submitted < WOKEN_WITHIN, (
        f"answered {poll.answered_at - submitted:.3f} s after the submission"
    )


def test_a_permit_released_on_one_server_wakes_a_long_poll_on_the_other(
    setup: Setup, two_servers: tuple[ServerProcess, ServerProcess]
) -> None:
    """The queue has ``max_concurrency`` 1 and its one permit is held: the long-poll on A waits for the second
    task until the attempt holding the permit completes through B, whose notification wakes it."""
    a, b = two_servers
    queue_path = f"{b.base_url}/v1/namespaces/{NS}/queues/{QUEUE}"
    with httpx.Client(timeout=30) as http:
        limited = http.patch(queue_path, json={"max_concurrency": 1}, headers=setup.headers("admin"))
        assert limited.status_code == 200, limited.text
        setup.submit(b.base_url, http)
        setup.submit(b.base_url, http)
        leased = http.post(
            f"{queue_path}/leases",
            json={"worker_id": "holder", "max_tasks": 2},
            headers=setup.headers("work"),
        )
        [grant] = leased.json()
        attempt = f"{b.base_url}/v1/namespaces/{NS}/attempts/{grant['attempt']['id']}"
        token = {"lease_token": grant["attempt"]["lease_token"]}
        assert http.post(f"{attempt}/start", json=token, headers=setup.headers("work")).status_code == 200
        poll = LongPoll(setup, a.base_url)
        poll.waiting()  # it looked and found the queue at its limit
        released = time.monotonic()
        done = http.post(f"{attempt}/complete", json={**token, "result": {}}, headers=setup.headers("work"))
        assert done.status_code == 200, done.text
    assert poll.answered.wait(timeout=25)
    poll.join()
    [woken] = poll.grants
    assert woken["task"]["id"] != grant["task"]["id"]  # type: ignore[index]  # the second task, held back
    assert poll.answered_at - released < WOKEN_WITHIN, (
        f"answered {poll.answered_at - released:.3f} s after the permit was released"
    )


def test_without_notify_the_other_server_waits_for_its_poll(setup: Setup) -> None:
    """The control: ``ORBIT_NOTIFY=false`` on B, so the grant on A waits for A's poll (5 s here: its first look
    for tasks, :meth:`LongPoll.waiting`'s sighting and the submission may take 1-2 s on a loaded machine, and
    the next look must still come more than a second after the submission)."""
    a = setup.spawn(setup.url, setup.tmp / "a.log", ORBIT_LEASE_POLL_INTERVAL_SECONDS="5")
    b = setup.spawn(setup.url, setup.tmp / "b.log", ORBIT_NOTIFY="false")
    _await(lambda: len(_listener_pids(setup.url)) == 1, "only A listens")
    poll = LongPoll(setup, a.base_url)
    poll.waiting()
    submitted = time.monotonic()
    setup.submit(b.base_url)
    assert poll.answered.wait(timeout=25)
    poll.join()
    assert len(poll.grants) == 1
    assert poll.answered_at - submitted > 1.0, "answered before A polled again: something else woke it"


def test_the_listener_reconnects_after_its_connection_is_killed(
    setup: Setup, two_servers: tuple[ServerProcess, ServerProcess]
) -> None:
    a, b = two_servers
    before = set(_listener_pids(setup.url))
    with _pg(setup.url) as conn:
        killed = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ANY(%s)",
                              (list(before),)).fetchall()  # fmt: skip
    assert killed == [(True,), (True,)]
    _await(lambda: len(set(_listener_pids(setup.url)) - before) == 2, "both listeners reconnect")
    poll = LongPoll(setup, a.base_url)
    poll.waiting()
    submitted = time.monotonic()
    setup.submit(b.base_url)
    assert poll.answered.wait(timeout=25)
    poll.join()
    assert len(poll.grants) == 1
    assert poll.answered_at - submitted < WOKEN_WITHIN, (
        f"answered {poll.answered_at - submitted:.3f} s after the submission"
    )
    assert "the wake-up listener's connection failed" in a.output()


def test_a_sender_whose_connection_was_killed_sends_on_a_new_one(
    setup: Setup, two_servers: tuple[ServerProcess, ServerProcess]
) -> None:
    a, b = two_servers
    first = LongPoll(setup, a.base_url)
    first.waiting()
    setup.submit(b.base_url)  # B's sender connects
    assert first.answered.wait(timeout=25) and len(first.grants) == 1
    [sender] = _listener_pids(setup.url, "sender")
    with _pg(setup.url) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (sender,)).fetchone() == (True,)
    poll = LongPoll(setup, a.base_url)
    poll.waiting()
    submitted = time.monotonic()
    setup.submit(b.base_url)
    assert poll.answered.wait(timeout=25)
    poll.join()
    assert len(poll.grants) == 1
    assert poll.answered_at - submitted < WOKEN_WITHIN, (
        f"answered {poll.answered_at - submitted:.3f} s after the submission"
    )
    assert _listener_pids(setup.url, "sender") not in ([], [sender])


def test_a_burst_of_submissions_sends_one_notification_per_interval(setup: Setup) -> None:
    """40 submissions at once through B, whose interval is 0.25 s: a LISTEN connection of the test's own
    counts what PostgreSQL delivered on the channel."""
    interval, submissions = 0.25, 40
    b = setup.spawn(setup.url, setup.tmp / "b.log", ORBIT_NOTIFY_INTERVAL_SECONDS=str(interval))
    with _pg(setup.url) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with httpx.Client() as client, ThreadPoolExecutor(8) as pool:
            started = time.monotonic()
            list(pool.map(lambda _: setup.submit(b.base_url, client), range(submissions)))
            elapsed = time.monotonic() - started
        # Everything published has left within one interval after the last submission.
        payloads = [n.payload for n in listener.notifies(timeout=interval * 4)]
    assert payloads, "no notification at all"
    wakes = {decode(p) for p in payloads}
    assert len(wakes) == 1 and next(iter(wakes)).queues is not None, wakes  # the one queue, named
    assert len(payloads) <= elapsed / interval + 2, (len(payloads), elapsed)
    assert len(payloads) <= submissions / 4, (len(payloads), elapsed)
    metrics = httpx.get(f"{b.base_url}/metrics", timeout=10).text
    assert f'orbit_notify_events_total{{event="sent"}} {float(len(payloads))}' in metrics, metrics


def test_a_step_result_on_one_server_runs_the_flow_loop_of_the_other(setup: Setup) -> None:
    """B runs no flow loop and A's passes 30 s apart, and both poll leases every 30 s: a step completed
    through B reaches A's loop (flow wake-up), whose next step task reaches a long-poll on B (lease wake-up)."""
    slow = {"ORBIT_LEASE_POLL_INTERVAL_SECONDS": SLOW_POLL}
    setup.spawn(setup.url, setup.tmp / "a.log", ORBIT_FLOW_INTERVAL_SECONDS="30", **slow)
    b = setup.spawn(setup.url, setup.tmp / "b.log", ORBIT_FLOW_INTERVAL_SECONDS="0", **slow)
    _await(lambda: len(_listener_pids(setup.url)) == 2, "both servers listen")
    api = FlowApi(b.base_url, NS, setup.keys)
    try:
        graph = {"start": "one", "nodes": {
            "one": {"type": "task", "queue": QUEUE, "handler": "one", "next": "two"},
            "two": {"type": "task", "queue": QUEUE, "handler": "two", "next": "end"},
            "end": {"type": "end"}}}  # fmt: skip
        api.publish("pair", graph)
        started = api.start("pair")
        [first] = api.lease(QUEUE, 1, wait=5)  # made by the start itself, on B
        assert first["task"]["handler"] == "one"
        completed = time.monotonic()
        api.finish(first, ("complete", {"done": 1}))
        [second] = api.lease(QUEUE, 1, wait=20)
        assert second["task"]["handler"] == "two"
        assert time.monotonic() - completed < 2 * WOKEN_WITHIN, (  # not A's or B's next pass, 30 s apart
            f"the next step came {time.monotonic() - completed:.3f} s later"
        )
        api.finish(second, ("complete", {"done": 2}))
        api.wait_status(started["id"], "COMPLETED")
    finally:
        api.close()
