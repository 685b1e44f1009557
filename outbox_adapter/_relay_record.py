"""The relay's records: the outcomes of a sent batch written in one short transaction (DESIGN §5).

One conditional update per outcome class, fenced on ``(id, lease_token)`` with a live lease, row
counts checked; a lost lease records nothing for its row. ``on_delivered`` runs in the same
transaction, under a savepoint. Each outcome is logged after the commit, so logs say what is true.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Connection

from outbox_adapter import _queries as q
from outbox_adapter import _tracing as outbox_tracing
from outbox_adapter._db import again_on_conflict, db_now
from outbox_adapter._exceptions import OutboxDatabaseError
from outbox_adapter._manager import Outbox
from outbox_adapter._metrics import RelayMetrics
from outbox_adapter._models import DeliveredRow, RelayStats
from outbox_adapter._outcomes import (
    Backoff,
    SendOutcome,
    Verdict,
)
from outbox_adapter._sending import Done

__all__ = ["Recorder"]

log = logging.getLogger("outbox_adapter.relay")

#: The savepoint each ``on_delivered`` call runs under (``Recorder._hooks_under``).
_HOOK_SAVEPOINT = "orbit_outbox_hook"


class _LeaseLost(Exception):
    """A set-based record came up short: roll back, then record only the rows still ours."""


class Recorder:
    """Records the outcomes of the batches one relay sent; runs on the relay's loop thread.

    Args:
        outbox: the relay's outbox (tables and transactions).
        owner: the relay's lease owner (the actor of the audit events: ``relay:<owner>``).
        backoff: waits between a row's tries (persisted in ``available_at``).
        on_delivered: called for each delivered row in the recording transaction (see :class:`Relay`).
        metrics: count recorded outcomes into these (``None``: none).
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        owner: str,
        backoff: Backoff,
        on_delivered: Callable[[Connection, DeliveredRow], None] | None,
        metrics: RelayMetrics | None,
    ) -> None:
        self.outbox = outbox
        self.owner = owner
        self.backoff = backoff
        self.on_delivered = on_delivered
        self.metrics = metrics
        #: Rows whose last recorded outcome in this run was "Orbit unreachable or refusing our key".
        self.unavailable: set[int] = set()

    def record_batch(self, done: Done, stats: RelayStats) -> None:
        """Record the outcomes of one batch in one transaction: one conditional update per outcome
        class, fenced on ``(id, lease_token)`` with a live lease, row counts checked; audit events in
        one insert; ``on_delivered`` per delivered row in the same transaction, under a savepoint.

        When a count comes up short (a lease was lost), the transaction is rolled back and done
        again for the rows one ``SELECT`` finds still ours. When ``on_delivered`` raises for a row
        (any exception, a database error included), its savepoint is rolled back and only that row
        is left out: it stays leased until its lease expires and is then resent (the server replays).
        """
        batch = done.batch
        pairs = list(zip(batch.claims, done.outcomes, strict=True))
        live: set[int] | None = None
        skipped: dict[int, Exception] = {}
        for _ in range(3):
            skipped = {}

            def once(live: set[int] | None = live, skipped: dict[int, Exception] = skipped) -> dict[int, str]:
                skipped.clear()
                return self._record_once(pairs, batch.token, live, skipped)

            try:
                # A lock conflict (on Galera: another node's write, met at COMMIT) is run again at once,
                # not waited out as an outage: the leases are still ours.
                written = again_on_conflict(once)
            except _LeaseLost:
                if live is not None:
                    raise OutboxDatabaseError(  # a lease changed under the row lock: try again later
                        "cannot record send outcomes: a lease changed while its row was locked",
                        retryable=True,
                    ) from None
                live = set()  # find them in the next transaction
                continue
            break
        else:  # pragma: no cover - the second round records only rows found live under their lock
            raise OutboxDatabaseError("cannot record send outcomes: no stable set of rows", retryable=True)
        if self.metrics is not None:
            self.metrics.recorded(written.values(), lost=len(pairs) - len(written) - len(skipped))
        for claim, outcome in pairs:  # after the commit: logs say what is true
            if claim.id in skipped:
                self._log_hook_failed(claim, skipped[claim.id])
            elif claim.id in written:
                kind = written[claim.id]
                self._log_recorded(kind, claim, outcome, kind, stats)
            else:
                self._log_recorded("lost", claim, outcome, self._kind(claim, outcome), stats)

    def _kind(self, claim: q.Claim, outcome: SendOutcome | None) -> str:
        return self._plan(claim, outcome, datetime(2000, 1, 1), "")[0]

    def _record_once(
        self,
        pairs: list[tuple[q.Claim, SendOutcome | None]],
        token: str,
        live: set[int] | None,
        skipped: dict[int, Exception],
    ) -> dict[int, str]:
        """One recording transaction; returns what was written per row id (rows whose hook failed
        are added to ``skipped`` and not written)."""
        t = self.outbox.tables
        actor = f"relay:{self.owner}"
        with self.outbox.transaction("record send outcomes") as conn:
            now = db_now(conn)
            if live is not None:
                live |= q.live_claims(conn, t, [c.id for c, _ in pairs], token=token, now=now)
            planned: list[tuple[q.Claim, str, q.Finish, dict[str, Any] | None]] = []
            delivered: list[tuple[q.Claim, SendOutcome]] = []
            for claim, outcome in pairs:
                if live is not None and claim.id not in live:
                    continue
                kind, finish, event = self._plan(claim, outcome, now, actor)
                planned.append((claim, kind, finish, event))
                if kind == "delivered":
                    assert outcome is not None
                    delivered.append((claim, outcome))
            if self.on_delivered is not None and delivered:
                skipped.update(self._run_hooks(conn, delivered))
            finishes = [finish for claim, _, finish, _ in planned if claim.id not in skipped]
            if finishes and not q.finish_claims(conn, t, finishes, token=token, now=now):
                raise _LeaseLost
            events = [
                event for claim, _, _, event in planned if event is not None and claim.id not in skipped
            ]
            q.add_events(conn, t, events)
        return {claim.id: kind for claim, kind, _, _ in planned if claim.id not in skipped}

    def _run_hooks(
        self, conn: Connection, delivered: list[tuple[q.Claim, SendOutcome]]
    ) -> dict[int, Exception]:
        """Call ``on_delivered`` for each delivered row, inside the recording transaction and before
        the rows are marked; returns the rows whose hook failed, with the exception.

        All hooks first run under one savepoint (two statements per batch). If one raises, or
        leaves the transaction unusable (a database error it caught itself: PostgreSQL then
        refuses the savepoint's release), that savepoint is rolled back and each hook runs again
        under a savepoint of its own, so only the failing rows are left out. A failure to roll
        back to a savepoint (the database ended the whole transaction, e.g. a deadlock on
        MySQL/MariaDB) propagates: the batch is recorded again later.
        """
        assert self.on_delivered is not None
        rows = [
            (claim, DeliveredRow(row_id=claim.id, idempotency_key=claim.idempotency_key,
                                 business_ref=claim.business_ref, orbit_task_id=outcome.task_id or "",
                                 replayed=outcome.replayed, kind=claim.kind))
            for claim, outcome in delivered
        ]  # fmt: skip
        if self._hooks_under(conn, [row for _, row in rows]) is None:
            return {}
        failed: dict[int, Exception] = {}
        for claim, row in rows:
            exc = self._hooks_under(conn, [row])
            if exc is not None:
                failed[claim.id] = exc
        return failed

    def _hooks_under(self, conn: Connection, rows: list[DeliveredRow]) -> Exception | None:
        """Run ``on_delivered`` for ``rows`` under one savepoint; on failure roll back to it and
        return the exception. Plain ``SAVEPOINT`` statements: SQLAlchemy's nested transaction does
        not roll back after a failed ``RELEASE`` (PostgreSQL, when the hook caught a database error)."""
        assert self.on_delivered is not None
        conn.exec_driver_sql(f"SAVEPOINT {_HOOK_SAVEPOINT}")
        try:
            for row in rows:
                self.on_delivered(conn, row)
            conn.exec_driver_sql(f"RELEASE SAVEPOINT {_HOOK_SAVEPOINT}")
        except Exception as exc:
            conn.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {_HOOK_SAVEPOINT}")
            conn.exec_driver_sql(f"RELEASE SAVEPOINT {_HOOK_SAVEPOINT}")
            return exc
        return None

    def _plan(
        self, claim: q.Claim, outcome: SendOutcome | None, now: datetime, actor: str
    ) -> tuple[str, q.Finish, dict[str, Any] | None]:
        """What to write for one row: (kind, the update, the audit event or ``None``)."""
        if outcome is None:
            return "released", q.Finish(row_id=claim.id, state=q.PENDING, give_back=True), None
        verdict = outcome.verdict
        error = outcome.error or ""
        code = outcome.status_code
        if verdict is Verdict.DELIVERED:
            assert outcome.task_id is not None
            how = "replayed the original task (200)" if outcome.replayed else "accepted (201)"
            if claim.is_flow:
                how = (
                    f"replayed the original instance of flow {claim.flow!r} (200)"
                    if outcome.replayed
                    else f"started an instance of flow {claim.flow!r} (201)"
                )
            finish = q.Finish(row_id=claim.id, state=q.DELIVERED, task_id=outcome.task_id, status_code=code)
            event = q.event_values(claim.id, q.PENDING, q.DELIVERED, reason=f"the server {how}", actor=actor,
                                   now=now, task_id=outcome.task_id)  # fmt: skip
            return "delivered", finish, event
        if verdict is Verdict.UNKNOWN and claim.attempts >= claim.budget:
            verdict = Verdict.RECONCILE
            error = (
                f"outcome unknown after {claim.attempts} of {claim.budget} attempts; the task may exist: run "
                f"`orbit-outbox reconcile`; last error: {error}"
            )
        elif verdict is Verdict.DEAD and claim.attempts > 1:
            # Once unknown, never DEAD (DESIGN §5): an earlier send of this row may have created the task.
            verdict = Verdict.RECONCILE
            error = (
                f"refused ({error}), but {claim.attempts - 1} earlier send(s) had an unknown outcome, so the task "
                "may exist: run `orbit-outbox reconcile`"
            )
        if verdict in (Verdict.NOT_SENT, Verdict.UNKNOWN):
            # The server down or refusing the relay's key is one condition of the relay, not of the row:
            # the row spends no backoff of its own (the relay probes, or stops); a Retry-After is still
            # the server's word.
            due = (
                None
                if outcome.orbit_unavailable and outcome.retry_after is None
                else now + timedelta(seconds=self.backoff.delay(claim.send_count, outcome.retry_after))
            )
            finish = q.Finish(row_id=claim.id, state=q.PENDING, available_at=due, error=error, status_code=code,
                              give_back=verdict is Verdict.NOT_SENT)  # fmt: skip
            return "retry", finish, None
        if verdict is Verdict.DEAD:
            finish = q.Finish(row_id=claim.id, state=q.DEAD, error=error, status_code=code)
            return (
                "dead",
                finish,
                q.event_values(claim.id, q.PENDING, q.DEAD, reason=error, actor=actor, now=now),
            )
        finish = q.Finish(row_id=claim.id, state=q.NEEDS_RECONCILE, error=error, status_code=code)
        event = q.event_values(claim.id, q.PENDING, q.NEEDS_RECONCILE, reason=error, actor=actor, now=now)
        return "needs_reconcile", finish, event

    def _log_hook_failed(self, claim: q.Claim, exc: Exception) -> None:
        log.error(
            "row %d: on_delivered failed (%s: %s); nothing recorded; the lease will expire and the row "
            "will be resent with the same key (the server replays)",
            claim.id,
            type(exc).__name__,
            exc,
            extra={"event": "hook_failed", "row_id": claim.id, "idempotency_key": claim.idempotency_key},
        )

    def _log_recorded(
        self, kind: str, claim: q.Claim, outcome: SendOutcome | None, intended: str, stats: RelayStats
    ) -> None:
        extra: dict[str, Any] = {
            "event": kind,
            "row_id": claim.id,
            "idempotency_key": claim.idempotency_key,
            "attempts": claim.attempts,
        }
        if claim.traceparent is not None:
            extra.update(outbox_tracing.log_ids(claim))
        if outcome is not None:
            extra["status_code"] = outcome.status_code
            if outcome.task_id:
                extra["orbit_task_id"] = outcome.task_id
        if kind == "retry" and outcome is not None and outcome.orbit_unavailable:
            self.unavailable.add(claim.id)
        elif kind != "lost":
            self.unavailable.discard(claim.id)
        if kind == "lost":
            stats.lost_leases += 1
            extra["lost"] = intended
            log.warning(
                "row %d (key %s): lease lost (expired or taken over); outcome %r not recorded; the row's owner "
                "now decides",
                claim.id,
                claim.idempotency_key,
                intended,
                extra=extra,
            )
        elif kind == "delivered":
            assert outcome is not None
            stats.delivered += 1
            stats.replayed += outcome.replayed
            extra["replayed"] = outcome.replayed
            log.info(
                "row %d (key %s) delivered as %s %s%s",
                claim.id,
                claim.idempotency_key,
                "flow instance" if claim.is_flow else "task",
                outcome.task_id,
                " (replayed)" if outcome.replayed else "",
                extra=extra,
            )
        elif kind == "retry":
            assert outcome is not None
            stats.retried += 1
            # Orbit unreachable or refusing the key: the relay logs that once, not once per row.
            level = logging.DEBUG if outcome.orbit_unavailable else logging.WARNING
            log.log(
                level,
                "row %d (key %s) will be retried (%s): %s",
                claim.id,
                claim.idempotency_key,
                outcome.verdict.value,
                outcome.error,
                extra={**extra, "verdict": outcome.verdict.value},
            )
        elif kind == "dead":
            stats.dead += 1
            log.error(
                "row %d (key %s) is DEAD: %s",
                claim.id,
                claim.idempotency_key,
                outcome.error if outcome else "",
                extra=extra,
            )
        elif kind == "needs_reconcile":
            stats.needs_reconcile += 1
            log.warning(
                "row %d (key %s) needs reconcile: %s",
                claim.id,
                claim.idempotency_key,
                outcome.error if outcome else "",
                extra=extra,
            )
        elif kind == "released":
            stats.released += 1
            log.info("row %d (key %s) released unsent", claim.id, claim.idempotency_key, extra=extra)
