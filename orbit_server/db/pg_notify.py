"""Wake-ups across server processes on PostgreSQL: ``LISTEN/NOTIFY``, sent after commit and debounced.

Each server process wakes its own long-polling lease calls and flow loop at once when it commits work for
them (:mod:`orbit_server.api.wakeup`, :mod:`orbit_server.db.flow_hooks`). On PostgreSQL a :class:`PgNotifier`
also carries those wake-ups to the *other* processes on the same database:

- **Sending.** :meth:`PgNotifier.publish` is called after the transaction that made the work committed (never
  from a trigger, never inside the writing transaction). It only records what to wake (the ``(namespace id,
  queue)`` of a lease wake-up, or "all queues", and whether the flow loops should run) and returns. A sender
  task sends what was recorded as **one** ``pg_notify`` on its own connection, in its own (autocommit)
  transaction, then waits ``interval_seconds`` before it sends again: the first wake-up after a quiet spell
  leaves at once, a burst leaves as one notification per interval whatever its size. A send that fails is
  tried once more on a fresh connection (the database may have dropped the idle one), then dropped.
- **Listening.** One dedicated connection per process runs ``LISTEN orbit_wakeup`` and hands each
  notification to ``on_wake``. When it drops it is opened again after a backoff (0.1 s doubling to 5 s, with
  jitter), and every reconnect wakes everything once, since notifications sent meanwhile are lost.
- **Polling stays the guarantee.** A lost, dropped or failed notification only delays work to the next poll
  (``ORBIT_LEASE_POLL_INTERVAL_SECONDS``, ``ORBIT_FLOW_INTERVAL_SECONDS``); nothing waits for a notification.

Why after commit and debounced, not a trigger: a transaction that ran ``NOTIFY`` takes a lock on the
cluster-wide notification queue at commit and holds it until its commit is flushed, so notifying commits are
serialised. Job systems on PostgreSQL met this and moved the same way: Oban 2.17 moved its insert
notifications out of database triggers into application code (changelog "Universal Insert Notifications");
River's v4 migration dropped its job-insert ``NOTIFY`` trigger for application-level notifications
(riverqueue/river#301); DBOS sends stream and workflow-event notifications in 10 ms batches off the write
path, reporting stream throughput with concurrent readers going from about 3,000 to 55,000 per second
(dbos-inc/dbos-transact-py#774 and #778). ``LISTEN`` needs a session: it does not pass PgBouncer's
transaction pooling (turn it off there with ``ORBIT_NOTIFY=false``; polling still works).

Payload (at most 8,000 bytes, PostgreSQL's limit): JSON ``{"l": [[namespace_id, "queue"], ...] | "*",
"f": 1}``, either key left out when it has nothing to say. A wake-up list that would not fit is sent as
``"*"`` (wake every queue). Notifications this process sent itself are skipped by the listener (it already
woke its own waiters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from sqlalchemy.engine import Engine

if TYPE_CHECKING:  # imported when a notifier is made: a server without the postgres extra never needs it
    import psycopg

__all__ = ["CHANNEL", "EVENTS", "MAX_PAYLOAD_BYTES", "PgNotifier", "Wake", "decode", "encode"]

log = logging.getLogger("orbit_server.notify")

#: The ``LISTEN`` channel of every Orbit server on a database.
CHANNEL = "orbit_wakeup"
#: PostgreSQL refuses a payload of 8,000 bytes or more; a longer wake-up list becomes "every queue".
MAX_PAYLOAD_BYTES = 7_900

LeaseKey = tuple[int, str]
#: Seconds a dedicated connection may take to open (libpq's ``connect_timeout``).
_CONNECT_TIMEOUT = 5
#: Seconds between two sends while sending fails (the database is down or unreachable).
_FAILED_SEND_PAUSE = 1.0

#: Registered in the app's ``/metrics`` (:class:`orbit_server.api.metrics.Metrics`).
EVENTS = Counter(
    "orbit_notify_events",
    "Wake-up notifications across server processes (PostgreSQL): sent by this process, received from "
    "another, send_failed (dropped: the others poll), listener_connected (each connect and reconnect).",
    ["event"],
    registry=None,
)


@dataclass(frozen=True)
class Wake:
    """What a notification asks to wake: the long-polls of ``queues`` (``None``: of every queue; empty:
    none) and, with ``flow``, the flow loop."""

    queues: frozenset[LeaseKey] | None
    flow: bool


#: What a (re)connected listener hands on: notifications may have been missed, so everything wakes.
WAKE_ALL = Wake(queues=None, flow=True)


def encode(queues: Iterable[LeaseKey] | None, *, flow: bool) -> str:
    """The payload for ``queues`` (``None``: every queue) and ``flow``; "every queue" when the list is too long."""
    body: dict[str, Any] = {}
    if queues is None:
        body["l"] = "*"
    else:
        listed = sorted(queues)
        if listed:
            body["l"] = [[namespace_id, queue] for namespace_id, queue in listed]
    if flow:
        body["f"] = 1
    text = json.dumps(body, separators=(",", ":"))
    if len(text.encode()) > MAX_PAYLOAD_BYTES:
        return encode(None, flow=flow)
    return text


def decode(payload: str) -> Wake:
    """The :class:`Wake` of a payload; one that cannot be read wakes everything (it is only a hint)."""
    try:
        body = json.loads(payload)
        listed = body.get("l")
        queues = (
            None
            if listed == "*"
            else frozenset((int(n), str(q)) for n, q in listed)
            if listed
            else frozenset()
        )
        return Wake(queues=queues, flow=bool(body.get("f")))
    except (ValueError, TypeError, AttributeError):
        return WAKE_ALL


class PgNotifier:
    """Sends and receives this process's wake-ups over ``LISTEN/NOTIFY`` (module docstring).

    Args:
        engine: a ``postgresql+psycopg`` engine; its URL and connect arguments open the two dedicated
            connections (never taken from its pool).
        on_wake: called on the event loop that runs :meth:`run`, for each notification another process
            sent and once after every (re)connect of the listener (:data:`WAKE_ALL`). It must only wake
            (set events) and not block.
        interval_seconds: least time between two notifications this process sends, in seconds (default
            0.01); wake-ups published meanwhile are sent together at its end.
        backoff_base_seconds, backoff_cap_seconds: the listener's wait before reconnecting, in seconds:
            ``base * 2**(failures - 1)`` capped at ``cap``, times a random factor in [0.5, 1].
        sleep: awaited for every wait (tests may pass a fake).
        channel: the channel name (tests use their own).

    Counters (read by tests and worth logging): ``sent`` notifications, ``received`` notifications from
    other processes, ``connects`` of the listener.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        on_wake: Callable[[Wake], None],
        interval_seconds: float = 0.01,
        backoff_base_seconds: float = 0.1,
        backoff_cap_seconds: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        channel: str = CHANNEL,
    ) -> None:
        if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
            raise ValueError("LISTEN/NOTIFY wake-ups need a postgresql+psycopg:// database URL")
        _args, kwargs = engine.dialect.create_connect_args(engine.url)
        # The URL's own connection parameters win over these defaults.
        self._connect_kwargs: dict[str, Any] = {
            "connect_timeout": _CONNECT_TIMEOUT,
            # A peer that vanished without a reset is noticed in about a minute, not never.
            "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3,
            **{k: v for k, v in kwargs.items() if v is not None},
        }  # fmt: skip
        self._on_wake = on_wake
        self._interval = interval_seconds
        self._base = backoff_base_seconds
        self._cap = backoff_cap_seconds
        self._sleep = sleep
        self._channel = channel
        self._lock = threading.Lock()
        self._queues: set[LeaseKey] = set()
        self._all = False
        self._flow = False
        self._armed = False  # something is recorded and the sender was told
        self._due: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: psycopg.AsyncConnection[Any] | None = None
        self._sender_pid: int | None = None
        self.sent = 0
        self.received = 0
        self.connects = 0

    # ------------------------------------------------------------------ sending

    def publish(self, queue: LeaseKey | None = None, *, flow: bool = False, leases: bool = True) -> None:
        """Record a wake-up for the other processes (thread-safe; returns at once, never touches the database).

        Args:
            queue: the ``(namespace id, queue name)`` whose long-polls to wake; ``None``: every queue.
            flow: also wake the flow loops.
            leases: ``False`` for a flow-only wake-up (``queue`` is then ignored).
        """
        with self._lock:
            if leases:
                if queue is None:
                    self._all = True
                else:
                    self._queues.add(queue)
            self._flow = self._flow or flow
            if self._armed:
                return
            self._armed = True
        loop, due = self._loop, self._due
        if loop is not None and due is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(due.set)

    def _take(self) -> str | None:
        with self._lock:
            queues, every, flow = self._queues, self._all, self._flow
            self._queues, self._all, self._flow, self._armed = set(), False, False, False
        if not (queues or every or flow):
            return None
        return encode(None if every else queues, flow=flow)

    async def _send_forever(self) -> None:

        assert self._due is not None
        failing = False
        while True:
            await self._due.wait()
            self._due.clear()
            payload = self._take()
            if payload is None:
                continue
            for attempt in (1, 2):  # a connection the database dropped while idle gets one fresh retry
                try:
                    sender = await self._sender_connection()
                    await sender.execute("SELECT pg_notify(%s, %s)", (self._channel, payload))
                    self.sent += 1
                    EVENTS.labels("sent").inc()
                    failing = False
                    break
                except Exception as exc:  # psycopg.Error, OSError: the wake-up is only a hint
                    await self._close_sender()
                    if attempt == 1:
                        continue
                    # Dropped, not kept: the other processes find the work by polling.
                    EVENTS.labels("send_failed").inc()
                    if not failing:
                        log.warning(
                            "sending a wake-up notification failed (%s); other server processes poll", exc
                        )
                    failing = True
            # At most one notification per interval: the next carries what was published meanwhile. While
            # the database cannot be reached, a try a second.
            await self._sleep(_FAILED_SEND_PAUSE if failing else self._interval)

    async def _sender_connection(self) -> psycopg.AsyncConnection[Any]:
        import psycopg

        if self._sender is None or self._sender.closed:
            self._sender = await psycopg.AsyncConnection.connect(
                **{
                    **self._connect_kwargs,
                    "autocommit": True,
                    "application_name": "orbit-server notify sender",
                }
            )
            self._sender_pid = self._sender.info.backend_pid
        return self._sender

    async def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            with contextlib.suppress(Exception):
                await sender.close()

    # ---------------------------------------------------------------- listening

    async def _listen_forever(self) -> None:
        import psycopg
        from psycopg import sql

        failures = 0
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    **{
                        **self._connect_kwargs,
                        "autocommit": True,
                        "application_name": "orbit-server notify listener",
                    }
                )
                async with conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    self.connects += 1
                    EVENTS.labels("listener_connected").inc()
                    if failures:
                        log.info("the wake-up listener is connected again")
                    failures = 0
                    self._on_wake(WAKE_ALL)  # whatever was sent while this was not listening
                    async for note in conn.notifies():
                        if note.pid == self._sender_pid:
                            continue  # this process's own: its waiters were woken when it published
                        self.received += 1
                        EVENTS.labels("received").inc()
                        self._on_wake(decode(note.payload))
            except Exception as exc:  # psycopg.Error, OSError; anything else must not end the wake-ups either
                failures += 1
                delay = min(self._cap, self._base * 2 ** min(failures - 1, 16)) * random.uniform(0.5, 1.0)
                if failures == 1:
                    log.warning(
                        "the wake-up listener's connection failed (%s); reconnecting in %.2f s, polling meanwhile",
                        exc, delay,
                    )  # fmt: skip
                else:
                    log.debug("the wake-up listener failed again (%d in a row): %s", failures, exc)
                await self._sleep(delay)

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Listen and send until cancelled (the app's lifespan runs it as a task); closes its connections."""
        self._loop = asyncio.get_running_loop()
        self._due = asyncio.Event()
        with self._lock:
            if self._armed:
                self._due.set()
        try:
            async with asyncio.TaskGroup() as group:  # one failing cancels the other
                group.create_task(self._listen_forever(), name="orbit-notify-listener")
                group.create_task(self._send_forever(), name="orbit-notify-sender")
        finally:
            await self._close_sender()
