"""``Outbox``: the outbox of one business database, and every operator operation on it.

All transactions of the relay and the CLI begin here (:meth:`Outbox.transaction`), and every
statement they run lives in ``_queries``, ``_operator_queries`` or ``_inbox_queries`` (STYLE
habit 15, as procrastinate's manager); reconciling is carried out by ``_reconcile``. An engine
the application built is used as it is and never disposed of.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import Self

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from orbit_client import OrbitClient
from outbox_adapter import _inbox_queries as iq
from outbox_adapter import _migrate, _ordering, _reconcile
from outbox_adapter import _operator_queries as oq
from outbox_adapter import _queries as q
from outbox_adapter._db import (
    create_engine,
    db_now,
    describe_url,
    pin_connection,
    short_transaction,
    transaction_on,
    translate_db_error,
)
from outbox_adapter._exceptions import InvalidStateError, OutboxUsageError, RowNotFoundError
from outbox_adapter._models import (
    InboxRow,
    OutboxEvent,
    OutboxRow,
    OutboxStatus,
    ReconcileDecision,
)
from outbox_adapter._ordering import BlockedKey
from outbox_adapter._reconcile import DeliveredHook
from outbox_adapter._tables import InboxOutcome, OutboxState, OutboxTables

__all__ = ["DEFAULT_KEY_WINDOW_SECONDS", "Outbox"]

log = logging.getLogger("outbox_adapter")

#: How long the server remembers an idempotency key, in seconds (server default: 7 days).
DEFAULT_KEY_WINDOW_SECONDS = 7 * 24 * 3600.0


class Outbox:
    """The outbox (and inbox) tables of one business database, with the operator operations of README "Outbox".

    Give exactly one of ``engine`` and ``database_url``.

    Args:
        engine: an engine the application built; used as is and never disposed of.
        database_url: a SQLAlchemy URL; the ``Outbox`` then builds its own engine (SQLite:
            ``BEGIN IMMEDIATE``, 30 s busy timeout; MySQL/MariaDB: ``READ COMMITTED``) and
            disposes of it in :meth:`close`.
        tables: the outbox tables; ``None`` means ``OutboxTables()`` (``orbit_outbox``).
        pool_size: connections kept by an engine built from ``database_url``.

    Raises:
        OutboxUsageError: both or neither of ``engine`` / ``database_url`` given, or the
            URL is malformed or unsupported.
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        database_url: str | URL | None = None,
        tables: OutboxTables | None = None,
        pool_size: int = 5,
    ) -> None:
        if (engine is None) == (database_url is None):
            raise OutboxUsageError("give exactly one of engine= and database_url=")
        self._owns_engine = engine is None
        if engine is None:
            assert database_url is not None
            engine = create_engine(database_url, pool_size=pool_size)
        self.engine: Engine = engine
        self.tables = tables or OutboxTables()
        #: Threads inside :meth:`pinned`, and the connection each one holds (``None``: none yet).
        self._pinned: dict[int, Connection | None] = {}

    def __repr__(self) -> str:
        return f"Outbox(url={describe_url(self.engine.url)!r}, tables={self.tables!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Dispose of the engine if this ``Outbox`` built it; an application's engine is left alone."""
        if self._owns_engine:
            self.engine.dispose()

    @contextmanager
    def transaction(self, what: str, *, row_id: int | None = None) -> Iterator[Connection]:
        """One short transaction (see ``short_transaction``): commits on success, rolls back on error.

        Inside :meth:`pinned`, it runs on the thread's pinned connection.

        Args:
            what: what the transaction does, for the error message, e.g. ``"claim a batch"``.
            row_id: the row concerned, carried by the error.

        Raises:
            OutboxDatabaseError: translated from any SQLAlchemy error (``__cause__`` keeps it).
        """
        ident = threading.get_ident()
        try:
            if ident not in self._pinned:
                with short_transaction(self.engine) as conn:
                    yield conn
                return
            pinned = self._pinned[ident]
            if pinned is None or pinned.closed or pinned.invalidated:
                if pinned is not None:
                    pinned.close()
                self._pinned[ident] = None
                pinned = self._pinned[ident] = pin_connection(self.engine)
            with transaction_on(pinned) as conn:
                yield conn
        except sa.exc.SQLAlchemyError as exc:
            raise translate_db_error(exc, what, row_id=row_id) from exc

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Run this thread's :meth:`transaction` calls on one connection, kept checked out until the
        block ends (the relay's loop): one checkout and one isolation ``SET`` in all, instead of a
        checkout and checkin (with the pool's reset ``ROLLBACK``, and an application engine's
        pre-ping) per transaction. A connection that fails is dropped and a new one taken."""
        ident = threading.get_ident()
        self._pinned[ident] = None
        try:
            yield
        finally:
            conn = self._pinned.pop(ident, None)
            if conn is not None:
                try:
                    conn.close()
                except sa.exc.SQLAlchemyError as exc:  # the database went away: nothing to give back
                    log.warning("closing the relay's database connection failed: %s", exc)

    # --- schema --------------------------------------------------------------------------------------

    def migrate(self) -> str | None:
        """Create or upgrade the outbox tables (Alembic history ``migrations/outbox``).

        Returns:
            The revision the database is at afterwards.

        Raises:
            OutboxDatabaseError: the database failed or is unreachable.
        """
        return _migrate.upgrade(self.engine, tables=self.tables)

    # --- reads ---------------------------------------------------------------------------------------

    def status(self) -> OutboxStatus:
        """Count rows per state; the oldest pending row's age (seconds) and the next due time (UTC).

        Raises:
            OutboxDatabaseError: the database failed; :class:`OutboxSchemaError` if not migrated.
        """
        with self.transaction("read the outbox status") as conn:
            return oq.count_by_state(conn, self.tables)

    def list_rows(self, *, state: str | None = None, limit: int = 50, after_id: int = 0) -> list[OutboxRow]:
        """Rows in ``state`` (``None``: every state; any case) with ``id > after_id``, by id, at most ``limit``.

        Raises:
            OutboxUsageError: ``state`` is not an :class:`OutboxState` or ``limit`` < 1.
            OutboxDatabaseError: the database failed.
        """
        if isinstance(state, str):
            state = state.upper()
        if state is not None and state not in OutboxState.__members__:
            raise OutboxUsageError(f"state must be one of {', '.join(OutboxState)}, not {state!r}")
        if limit < 1:
            raise OutboxUsageError("limit must be at least 1")
        with self.transaction("list outbox rows") as conn:
            return oq.list_rows(conn, self.tables, state=state, limit=limit, after_id=after_id)

    def get(self, row_id: int) -> OutboxRow:
        """The row with id ``row_id``.

        Raises:
            RowNotFoundError: no such row (never enqueued, or purged).
            OutboxDatabaseError: the database failed.
        """
        with self.transaction(f"read row {row_id}", row_id=row_id) as conn:
            row = q.get_row(conn, self.tables, row_id)
        if row is None:
            raise _not_found(row_id)
        return row

    def events(self, row_id: int) -> list[OutboxEvent]:
        """The audit trail of row ``row_id``, oldest first (empty for a row never changed).

        Raises:
            OutboxDatabaseError: the database failed.
        """
        with self.transaction(f"read the events of row {row_id}", row_id=row_id) as conn:
            return oq.list_events(conn, self.tables, row_id)

    def inbox_rows(
        self,
        *,
        outcome: str | None = None,
        subscription: str | None = None,
        limit: int = 50,
        after_id: int = 0,
    ) -> list[InboxRow]:
        """Inbox rows with ``id > after_id``, by id, at most ``limit``; only those of ``outcome``
        (``"APPLIED"`` or ``"FAILED"``) and ``subscription`` when given (``None``: any).

        Raises:
            OutboxUsageError: ``outcome`` is not an :class:`InboxOutcome` or ``limit`` < 1.
            OutboxDatabaseError: the database failed; :class:`OutboxSchemaError` if not migrated.
        """
        if outcome is not None and outcome not in InboxOutcome.__members__:
            raise OutboxUsageError(f"outcome must be one of {', '.join(InboxOutcome)}, not {outcome!r}")
        if limit < 1:
            raise OutboxUsageError("limit must be at least 1")
        with self.transaction("list inbox rows") as conn:
            return iq.list_inbox(
                conn, self.tables, outcome=outcome, subscription=subscription, limit=limit, after_id=after_id
            )

    def inbox_row(self, subscription: str, event_id: str) -> InboxRow | None:
        """The inbox row of result event ``event_id`` for ``subscription``, or ``None`` if it was never recorded.

        Raises:
            OutboxDatabaseError: the database failed; :class:`OutboxSchemaError` if not migrated.
        """
        with self.transaction(f"read the inbox row of event {event_id}") as conn:
            return iq.get_inbox_row(conn, self.tables, subscription=subscription, event_id=event_id)

    # --- operator actions ----------------------------------------------------------------------------

    def retry(self, row_id: int, *, actor: str, reason: str = "retried by an operator") -> OutboxRow:
        """Send a ``DEAD`` row again: ``DEAD`` → ``PENDING``, same key, fresh budget, due now; audited.

        Fix what made the server refuse it first (e.g. create the missing queue): the row's
        data and key never change (README "Outbox").

        Args:
            row_id: the row.
            actor: who retries, for the audit trail, e.g. ``"operator:alice"``.
            reason: why, for the audit trail.

        Returns:
            The row after the change.

        Raises:
            RowNotFoundError: no such row.
            InvalidStateError: the row is not ``DEAD`` (nothing changed).
            OutboxDatabaseError: the database failed (nothing changed).
        """
        with self.transaction(f"retry row {row_id}", row_id=row_id) as conn:
            row = q.get_row(conn, self.tables, row_id, for_update=True)
            if row is None:
                raise _not_found(row_id)
            if row.state != q.DEAD:
                hint = (
                    "run `orbit-outbox reconcile` for NEEDS_RECONCILE rows, or settle it with "
                    f"`orbit-outbox resolve {row_id} --delivered-as TASK_ID | --abandon --reason TEXT`"
                    if row.state == q.NEEDS_RECONCILE
                    else "an ABANDONED row is never sent: enqueue the work again, with a new key"
                    if row.state == q.ABANDONED
                    else "there is nothing to retry"
                )
                raise InvalidStateError(
                    f"row {row_id} is {row.state}, not DEAD; only DEAD rows can be retried ({hint})",
                    row_id=row_id,
                    state=row.state,
                )
            now = db_now(conn)
            oq.retry_dead_row(conn, self.tables, row_id, now=now)
            event = q.event_values(row_id, q.DEAD, q.PENDING, reason=reason, actor=actor, now=now)
            q.add_events(conn, self.tables, [event])
            after = q.get_row(conn, self.tables, row_id)
        assert after is not None
        log.info(
            "row %d retried by %s (key %s)",
            row_id,
            actor,
            row.idempotency_key,
            extra={"event": "retried", "row_id": row_id, "idempotency_key": row.idempotency_key},
        )
        return after

    def abandon(self, row_id: int, *, actor: str, reason: str) -> OutboxRow:
        """Give up a ``DEAD`` or ``NEEDS_RECONCILE`` row for good: → ``ABANDONED``, audited.

        ``ABANDONED`` is terminal: the row is never sent, and it no longer holds back later
        rows of its ordering key (README "Ordering keys"). For a ``NEEDS_RECONCILE`` row the
        task may exist: check first (``reconcile``, ``resolve --delivered-as``).

        Raises:
            OutboxUsageError: an empty ``reason``.
            RowNotFoundError: no such row.
            InvalidStateError: the row is neither ``DEAD`` nor ``NEEDS_RECONCILE`` (also when
                another process changed it meanwhile); nothing changed.
            OutboxDatabaseError: the database failed; nothing changed.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise OutboxUsageError(
                "give a reason for the audit trail, e.g. reason='order cancelled by the customer'"
            )
        with self.transaction(f"abandon row {row_id}", row_id=row_id) as conn:
            row = q.get_row(conn, self.tables, row_id, for_update=True)
            if row is None:
                raise RowNotFoundError(
                    f"there is no outbox row {row_id} (never enqueued, or purged); see `orbit-outbox list`",
                    row_id=row_id,
                )
            if row.state not in (q.DEAD, q.NEEDS_RECONCILE):
                raise InvalidStateError(
                    f"row {row_id} is {row.state}; only DEAD or NEEDS_RECONCILE rows can be abandoned "
                    f"(see `orbit-outbox show {row_id}`)",
                    row_id=row_id,
                    state=row.state,
                )
            now = db_now(conn)
            error = f"abandoned by operator: {reason}"
            if not oq.abandon_row(conn, self.tables, row_id, now=now, error=error, from_state=row.state):
                raise InvalidStateError(  # pragma: no cover - the row is locked (SQLite: single writer)
                    f"row {row_id} changed meanwhile; nothing was changed; see `orbit-outbox show {row_id}`",
                    row_id=row_id,
                    state=row.state,
                )
            released = f"; ordering key {row.ordering_key!r} released" if row.ordering_key is not None else ""
            event = q.event_values(row_id, row.state, q.ABANDONED, reason=f"abandoned by an operator{released}: {reason}",
                                   actor=actor, now=now)  # fmt: skip
            q.add_events(conn, self.tables, [event])
            after = q.get_row(conn, self.tables, row_id)
        assert after is not None
        log.info(
            "row %d (key %s) abandoned by %s%s",
            row_id,
            row.idempotency_key,
            actor,
            released,
            extra={"event": "abandoned", "row_id": row_id, "idempotency_key": row.idempotency_key},
        )
        return after

    def blocked_keys(self, *, limit: int = 100) -> list[BlockedKey]:
        """Ordering keys held back by a row that needs a person (its first unsent row is ``DEAD``
        or ``NEEDS_RECONCILE``), by that row's id, at most ``limit``.

        Raises:
            OutboxDatabaseError: the database failed; :class:`OutboxSchemaError` if not migrated.
        """
        with self.transaction("list blocked ordering keys") as conn:
            return _ordering.blocked_keys(conn, self.tables, limit=limit)

    def retry_all_dead(
        self, *, actor: str, reason: str = "retried by an operator (--all-dead)", batch_size: int = 500
    ) -> list[int]:
        """:meth:`retry` every ``DEAD`` row, ``batch_size`` rows per transaction. Returns their ids.

        Raises:
            OutboxDatabaseError: the database failed; rows of committed batches stay retried.
        """
        retried: list[int] = []
        after = 0
        while True:
            with self.transaction("retry DEAD rows") as conn:
                rows = oq.list_rows(conn, self.tables, state=q.DEAD, limit=batch_size, after_id=after)
                if not rows:
                    return retried
                now = db_now(conn)
                events = []
                for row in rows:
                    if oq.retry_dead_row(conn, self.tables, row.id, now=now):
                        retried.append(row.id)
                        events.append(
                            q.event_values(row.id, q.DEAD, q.PENDING, reason=reason, actor=actor, now=now)
                        )
                q.add_events(conn, self.tables, events)
            after = rows[-1].id

    def resolve(
        self,
        row_id: int,
        *,
        actor: str,
        reason: str,
        delivered_as: str | None = None,
        abandon: bool = False,
        client: OrbitClient | None = None,
        on_delivered: DeliveredHook | None = None,
    ) -> OutboxRow:
        """Settle a ``NEEDS_RECONCILE`` row that ``reconcile`` left to a person; audited.

        ``reconcile`` cannot decide a row whose key names a different submission
        (``mismatch``) or that is older than the server's key window (``too_old``). A person
        who has found out what happened settles it here, giving exactly one of:

        - ``delivered_as``: the row was delivered as that Orbit task → ``DELIVERED`` with its
          id. The task is looked up first (``client.get_task``, outside any transaction);
        - ``abandon``: the row must not be sent → ``ABANDONED`` with ``last_error``
          ``"abandoned by operator: <reason>"``: terminal, never sent, and it no longer holds
          back later rows of its ordering key (as :meth:`abandon`).

        The update is conditional on the row still being ``NEEDS_RECONCILE``.

        Args:
            row_id: the row.
            actor: who decides, for the audit trail, e.g. ``"operator:alice"``.
            reason: why, for the audit trail (required: a person's decision needs one).
            delivered_as: the Orbit task id the row's intent was delivered as.
            abandon: give the row up instead.
            client: an Orbit client with a key of the row's namespace (``read`` role or
                more); needed with ``delivered_as``.
            on_delivered: called inside the transaction that records ``DELIVERED`` (as
                ``reconcile``'s hook), to link the task to the business record.

        Returns:
            The row after the change.

        Raises:
            OutboxUsageError: not exactly one of ``delivered_as``/``abandon``, an empty
                ``reason``, or ``delivered_as`` without ``client``.
            RowNotFoundError: no such row.
            InvalidStateError: the row is not ``NEEDS_RECONCILE`` (also when another process
                changed it meanwhile); nothing changed.
            OutboxRowError: the server has no task ``delivered_as`` in the row's namespace;
                nothing changed.
            OrbitError: the task lookup failed (server unreachable, key refused); nothing changed.
            OutboxDatabaseError: the database failed; nothing changed.
        """
        return _reconcile.resolve(
            self,
            row_id,
            actor=actor,
            reason=reason,
            delivered_as=delivered_as,
            abandon=abandon,
            client=client,
            on_delivered=on_delivered,
        )

    def reconcile(
        self,
        client: OrbitClient,
        *,
        actor: str,
        dry_run: bool = False,
        key_window_seconds: float | None = None,
        batch_size: int = 100,
        on_decision: Callable[[ReconcileDecision], None] | None = None,
        on_delivered: DeliveredHook | None = None,
    ) -> list[ReconcileDecision]:
        """Settle every ``NEEDS_RECONCILE`` row by its original key (README "Outbox").

        For each row, ``GET /v1/namespaces/{ns}/submissions/{key}``:

        - a task whose queue, handler and params are the row's → ``DELIVERED`` with that task id;
        - no task → ``PENDING`` with the **same key** and a fresh budget, due now, unless the
          row is older than ``key_window_seconds`` (the server may have forgotten the key,
          so "not found" proves nothing: the row stays, decision ``"too_old"``);
        - a task for a different submission → the row stays (decision ``"mismatch"``);
        - a failed lookup → the row stays (decision ``"error"``); the next run tries again.

        A row that stays for a person (``mismatch``, ``too_old``) gets the decision in
        ``last_error`` and the audit table but ``applied=False``: its state did not change;
        settle it with :meth:`resolve`.

        Every decision that changes or keeps a row is written to the audit table in the
        transaction that applies it. Each row is decided on its own: the lookup happens
        outside any transaction, and the update is conditional on the row still being
        ``NEEDS_RECONCILE`` (another reconciler may have decided it first).

        Args:
            client: an Orbit client with a key of the rows' namespace (``read`` role or more).
            actor: who reconciles, for the audit trail.
            dry_run: look up and decide, write nothing (every decision has ``applied=False``).
            key_window_seconds: how long the server remembers keys, in seconds. ``None`` (the
                default): the server's own window, ``submission_key_ttl_seconds`` of
                ``GET /v1/settings``, less the relay's margin (a tenth, at most 1 h), read once
                per call; a server without that endpoint never purges keys (no row is too old);
                while the settings cannot be read, the shortest window a server allows (1 h) less
                its margin, so a row is never re-sent on a guess (README "Retention and the key
                window").
            batch_size: rows read per query.
            on_decision: called with each decision as it is made (progress display).
            on_delivered: called inside the transaction that records a ``DELIVERED``
                decision (as the relay's hook), to link the task to the business record.

        Returns:
            The decisions, in row id order.

        Raises:
            OutboxDatabaseError: the database failed; decisions already applied stay.
        """
        return _reconcile.reconcile(
            self,
            client,
            actor=actor,
            dry_run=dry_run,
            key_window_seconds=key_window_seconds,
            batch_size=batch_size,
            on_decision=on_decision,
            on_delivered=on_delivered,
        )

    def purge_delivered(
        self,
        *,
        older_than_seconds: float,
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Delete ``DELIVERED`` rows delivered more than ``older_than_seconds`` ago, with their events.

        Deletes in batches of at most ``batch_size`` rows, one short transaction each, and
        never touches a row in any other state (README "Outbox").

        Args:
            older_than_seconds: age, in seconds, measured from ``delivered_at`` to the
                database's now when the purge starts.
            batch_size: rows deleted per transaction, at least 1.
            on_batch: called with the number deleted after each committed batch (progress).

        Returns:
            The number of rows deleted.

        Raises:
            OutboxUsageError: a negative age or a batch size below 1.
            OutboxDatabaseError: the database failed; committed batches stay deleted.
        """
        if older_than_seconds < 0 or batch_size < 1:
            raise OutboxUsageError("older_than_seconds must be >= 0 and batch_size >= 1")
        with self.transaction("read the database clock") as conn:
            cutoff = db_now(conn) - timedelta(seconds=older_than_seconds)
        total = 0
        while True:
            with self.transaction("purge delivered rows") as conn:
                deleted = oq.purge_delivered_batch(conn, self.tables, cutoff=cutoff, batch_size=batch_size)
            total += deleted
            if on_batch is not None and deleted:
                on_batch(deleted)
            if deleted < batch_size:
                return total

    def purge_dead(
        self,
        *,
        older_than_seconds: float,
        actor: str,
        reason: str,
        row_ids: Collection[int] | None = None,
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Delete rows ``DEAD`` for more than ``older_than_seconds``: rows the operator decided
        never to send (e.g. a mistyped queue). Returns the ids deleted, in order.

        ``row_ids`` limits the purge to those rows (``older_than_seconds=0`` then deletes
        exactly the ones of them that are ``DEAD``); ``None`` means every ``DEAD`` row.

        A row's age is measured from its last change (``updated_at``, when it became
        ``DEAD``) to the database's now when the purge starts. Each row deleted keeps its
        audit trail plus one event ``DEAD`` → ``PURGED`` with ``actor`` and ``reason``, written
        in the transaction that deletes it (``orbit-outbox show ID`` then finds no row, but
        ``events(ID)`` still answers). Deleting a ``DEAD`` row releases the later rows of its
        ordering key. ``batch_size`` rows per transaction; no other state is touched.

        Raises:
            OutboxUsageError: a negative age, a batch size below 1, or an empty reason.
            OutboxDatabaseError: the database failed; committed batches stay deleted.
        """
        if older_than_seconds < 0 or batch_size < 1:
            raise OutboxUsageError("older_than_seconds must be >= 0 and batch_size >= 1")
        if not reason.strip():
            raise OutboxUsageError("a purge of DEAD rows needs a reason, for the audit trail")
        with self.transaction("read the database clock") as conn:
            cutoff = db_now(conn) - timedelta(seconds=older_than_seconds)
        purged: list[int] = []
        while True:
            with self.transaction("purge DEAD rows") as conn:
                ids = oq.purge_dead_batch(
                    conn, self.tables, cutoff=cutoff, batch_size=batch_size, reason=reason, actor=actor,
                    now=db_now(conn), row_ids=row_ids,
                )  # fmt: skip
            purged.extend(ids)
            if ids:
                log.info(
                    "%d DEAD row(s) purged by %s: %s",
                    len(ids), actor, ", ".join(map(str, ids)),
                    extra={"event": "purged", "row_ids": ids, "reason": reason},
                )  # fmt: skip
                if on_batch is not None:
                    on_batch(len(ids))
            if len(ids) < batch_size:
                return purged


def _not_found(row_id: int) -> RowNotFoundError:
    return RowNotFoundError(
        f"there is no outbox row {row_id} (never enqueued, or purged); see `orbit-outbox list`", row_id=row_id
    )
