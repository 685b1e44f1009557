"""The wake-up of long-polls by queue, and the payload of the wake-ups sent across processes (no database)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_server import errors
from orbit_server.api.wakeup import Wakeup
from orbit_server.db import lease_hooks
from orbit_server.db.pg_notify import MAX_PAYLOAD_BYTES, WAKE_ALL, PgNotifier, Wake, decode, encode
from orbit_server.db.transact import transact


async def test_a_wake_up_of_one_queue_wakes_its_long_polls_only() -> None:
    wakeup = Wakeup()
    wakeup.bind(asyncio.get_running_loop())
    jobs, mail = wakeup.current((1, "jobs")), wakeup.current((1, "mail"))
    assert jobs is not None and mail is not None
    assert wakeup.current((1, "jobs")) is jobs  # every long-poll of a queue waits on one event
    wakeup.notify((1, "jobs"))
    await asyncio.wait_for(jobs.wait(), 5)
    assert not mail.is_set()
    wakeup.notify()  # a commit that does not know its queue wakes them all
    await asyncio.wait_for(mail.wait(), 5)
    assert wakeup.current((1, "jobs")) is not jobs  # the next wait takes a new event


async def test_notify_hands_the_wake_up_to_the_publisher_and_wake_local_does_not() -> None:
    wakeup = Wakeup()
    wakeup.bind(asyncio.get_running_loop())
    published: list[tuple[int, str] | None] = []
    wakeup.publisher = published.append
    wakeup.notify((3, "jobs"))
    wakeup.notify()
    wakeup.wake_local((3, "jobs"))
    assert published == [(3, "jobs"), None]


async def test_notify_queues_wakes_and_publishes_each_queue() -> None:
    wakeup = Wakeup()
    wakeup.bind(asyncio.get_running_loop())
    published: list[tuple[int, str] | None] = []
    wakeup.publisher = published.append
    jobs, mail = wakeup.current((1, "jobs")), wakeup.current((2, "mail"))
    assert jobs is not None and mail is not None
    wakeup.notify_queues(frozenset({(1, "jobs"), (2, "mail")}))
    await asyncio.wait_for(asyncio.gather(jobs.wait(), mail.wait()), 5)
    assert sorted(published) == [(1, "jobs"), (2, "mail")]  # type: ignore[type-var]


@pytest.fixture
def heard() -> Iterator[tuple[sa.Engine, list[frozenset[tuple[int, str]]]]]:
    """An in-memory SQLite engine and what its :mod:`~orbit_server.db.lease_hooks` listener heard."""
    engine = sa.create_engine("sqlite://")
    got: list[frozenset[tuple[int, str]]] = []
    lease_hooks.add_listener(engine, got.append)
    yield engine, got
    lease_hooks.remove_listener(engine, got.append)
    engine.dispose()


def _releases(conn: Connection, keys: list[tuple[int, str]], then: Exception | None = None) -> None:
    conn.execute(sa.text("SELECT 1"))
    lease_hooks.mark(conn, keys)
    if then is not None:
        raise then


def test_a_commit_that_released_permits_tells_its_engine_listeners_of_their_queues(
    heard: tuple[sa.Engine, list[frozenset[tuple[int, str]]]],
) -> None:
    engine, got = heard
    other: list[frozenset[tuple[int, str]]] = []
    another = sa.create_engine("sqlite://")
    lease_hooks.add_listener(another, other.append)  # another engine's listener: not told
    try:
        transact(engine, _releases, [(1, "jobs"), (1, "jobs"), (2, "mail")])
    finally:
        lease_hooks.remove_listener(another, other.append)
    assert got == [frozenset({(1, "jobs"), (2, "mail")})] and other == []
    transact(engine, lambda conn: conn.execute(sa.text("SELECT 1")))  # released nothing: nobody is told
    assert len(got) == 1
    # A refusal whose writes are committed (a lapsed lease expired by a late report) wakes too.
    with pytest.raises(errors.LeaseLost):
        transact(engine, _releases, [(3, "late")], errors.LeaseLost("lapsed"))
    assert got[-1] == frozenset({(3, "late")})


def test_a_rolled_back_release_wakes_nobody_then_or_later(
    heard: tuple[sa.Engine, list[frozenset[tuple[int, str]]]],
) -> None:
    engine, got = heard
    with pytest.raises(errors.InvalidTransition):
        transact(engine, _releases, [(1, "jobs")], errors.InvalidTransition("no"))
    with pytest.raises(RuntimeError):
        transact(engine, _releases, [(1, "jobs")], RuntimeError("bug"))
    transact(engine, _releases, [(2, "mail")])  # the pooled connection carries no mark of the failures
    assert got == [frozenset({(2, "mail")})]


@pytest.mark.parametrize(
    ("queues", "flow", "expected"),
    [
        ({(1, "jobs"), (2, "mail")}, False, Wake(frozenset({(1, "jobs"), (2, "mail")}), False)),
        (None, True, WAKE_ALL),
        (set(), True, Wake(frozenset(), True)),
    ],
)
def test_a_payload_says_what_to_wake(queues: set[tuple[int, str]] | None, flow: bool, expected: Wake) -> None:
    assert decode(encode(queues, flow=flow)) == expected


def test_a_wake_up_list_past_the_payload_limit_wakes_every_queue() -> None:
    many = {(n, "q" * 60) for n in range(200)}
    payload = encode(many, flow=False)
    assert len(payload.encode()) <= MAX_PAYLOAD_BYTES < 8000
    assert decode(payload) == Wake(None, False)


@pytest.mark.parametrize("payload", ["", "not json", "[1]", '{"l": [[1]]}'])
def test_a_payload_that_cannot_be_read_wakes_everything(payload: str) -> None:
    assert decode(payload) == WAKE_ALL


def test_wake_ups_published_between_two_sends_leave_as_one_payload() -> None:
    notifier = PgNotifier(sa.create_engine("postgresql+psycopg://u@127.0.0.1/db"), on_wake=lambda wake: None)
    for n in range(50):
        notifier.publish((1, f"q{n % 3}"))
    notifier.publish(flow=True, leases=False)
    payload = notifier._take()
    assert payload is not None
    assert decode(payload) == Wake(frozenset({(1, "q0"), (1, "q1"), (1, "q2")}), True)
    assert notifier._take() is None  # nothing left: the sender sends nothing more


def test_the_notifier_refuses_another_database() -> None:
    with pytest.raises(ValueError, match="postgresql"):
        PgNotifier(sa.create_engine("sqlite://"), on_wake=lambda wake: None)


def test_a_failing_listener_never_fails_the_committed_call(
    heard: tuple[sa.Engine, list[frozenset[tuple[int, str]]]], caplog: pytest.LogCaptureFixture
) -> None:
    engine, got = heard

    def broken(keys: frozenset[tuple[int, str]]) -> None:
        raise RuntimeError("wake-up failed")

    later: list[frozenset[tuple[int, str]]] = []
    lease_hooks.add_listener(engine, broken)
    lease_hooks.add_listener(engine, later.append)
    try:
        assert transact(engine, lambda conn: _releases(conn, [(1, "jobs")]) or "answer") == "answer"
    finally:
        lease_hooks.remove_listener(engine, broken)
        lease_hooks.remove_listener(engine, later.append)
    assert got == later == [frozenset({(1, "jobs")})]  # the listeners before and after it were told
    assert "waking the long-polls of [(1, 'jobs')] failed" in caplog.text
