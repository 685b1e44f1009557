"""The relay's sends: a claimed batch to Orbit, outside any transaction, one outcome per row (DESIGN §5).

Runs on the relay's thread pool. Just before each request the lease is checked (``Sender.may_send``);
a batch goes as one ``POST /v1/namespaces/{ns}/tasks/batch``, a flow row as one flow start, and for a
server without the batch route each row alone after a (cached) queue check. The outcome of each row
is classified by ``_outcomes``; what it means for the row is decided when it is recorded
(``_relay_record``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta

from orbit_client import OrbitClient, OrbitError, OrbitUsageError, _tracing
from outbox_adapter import _flow_sending as flow_sending
from outbox_adapter import _queries as q
from outbox_adapter import _tracing as outbox_tracing
from outbox_adapter._faults import Faults
from outbox_adapter._outcomes import (
    SendOutcome,
    Verdict,
    accepted,
    classify_error,
    dead_queue_hint,
    item_outcome,
)
from outbox_adapter._sending import Batch, KeyWindow, QueueCache, route_missing

__all__ = ["Sender"]

log = logging.getLogger("outbox_adapter.relay")


def _trace_args(claim: q.Claim, trace: outbox_tracing.SendTrace | None) -> dict[str, str | None]:
    """The ``traceparent``/``tracestate`` arguments of a single submission of ``claim``."""
    if trace is None:
        return {}
    traceparent, tracestate = trace.headers(claim)
    return {"traceparent": traceparent, "tracestate": tracestate}


class Sender:
    """Sends claimed batches with one client; safe from the relay's send threads.

    Args:
        client: the relay's Orbit client.
        send_window: seconds of lease a send needs left to start (the lease rule of :class:`Relay`).
        queue_cache_ttl: seconds a found queue is remembered, for one-by-one submissions.
    """

    def __init__(self, client: OrbitClient, *, send_window: float, queue_cache_ttl: float) -> None:
        self.client = client
        self.send_window = send_window
        self.queues = QueueCache(client, queue_cache_ttl)
        self.key_window = KeyWindow(client)
        self.faults = Faults.from_env()
        #: ``False`` once the server answered that it has no batch route (an older server).
        self.batch_route = True

    def lease_left(self, batch: Batch) -> float:
        """Seconds of lease left now, by the database time of the claim plus the time elapsed since
        (measured from before the claim began, so never more than is really left)."""
        now = batch.claimed_at + timedelta(seconds=time.monotonic() - batch.claimed_mono)
        return (batch.lease_expires_at - now).total_seconds()

    def may_send(self, batch: Batch) -> bool:
        left = self.lease_left(batch)
        if left >= self.send_window:
            return True
        log.warning(
            "%d rows (first %d): %.2f s of lease left, less than the %.2f s a send may take; released unsent, "
            "they are claimed again",
            len(batch.claims),
            batch.claims[0].id,
            left,
            self.send_window,
            extra={
                "event": "lease_too_short_to_send",
                "row_id": batch.claims[0].id,
                "rows": len(batch.claims),
            },
        )
        return False

    def send(self, batch: Batch) -> list[SendOutcome | None]:
        """Send ``batch`` as one request; outside any transaction. One outcome per claim (``None``:
        released unsent).

        A row older than the server's key window (less a margin) is first settled by its key
        (README "Retention and the key window"); only the rest, and an old row never claimed before, are sent.
        """
        aged = self.key_window.aged(batch)
        if aged:
            limit = self.key_window.limit()
            settled = {c.id: self.key_window.settle(c, limit) for c in batch.claims if c.id in aged}
            send = [c for c in batch.claims if settled.get(c.id) is None]
            sent = self._send_unaged(dataclasses.replace(batch, claims=send)) if send else []
            by_id = dict(zip([c.id for c in send], sent, strict=True))
            return [settled[c.id] if settled.get(c.id) is not None else by_id[c.id] for c in batch.claims]
        return self._send_unaged(batch)

    def _send_unaged(self, batch: Batch) -> list[SendOutcome | None]:
        claims = batch.claims
        if self.faults is not None:
            self.faults.before_send(claims[0].id)
        if not self.may_send(batch):
            return [None] * len(claims)
        trace = outbox_tracing.start_send(batch.namespace, claims) if _tracing.AVAILABLE else None
        try:
            if batch.single:
                outcomes: list[SendOutcome | None] = [self._send_one(claims[0], trace, batch)]
            elif batch.flows:
                outcomes = [self._start_flow(c, trace) if self.may_send(batch) else None for c in claims]
            else:
                outcomes = self._submit_batch(batch, trace)
        except BaseException as exc:
            if trace is not None:
                outbox_tracing.finish_send(trace, claims, exc)
            raise
        if trace is not None:
            outbox_tracing.finish_send(trace, claims, outcomes)
        if self.faults is not None:
            self.faults.after_send(claims[0].id)
        return outcomes

    def _submit_batch(self, batch: Batch, trace: outbox_tracing.SendTrace | None) -> list[SendOutcome | None]:
        claims = batch.claims
        items = [
            {"idempotency_key": c.idempotency_key, "queue": c.queue, "handler": c.handler, "params": c.params,
             "options": c.options}
            for c in claims
        ]  # fmt: skip
        if trace is not None:
            for item, claim in zip(items, claims, strict=True):
                item["traceparent"], item["tracestate"] = trace.headers(claim)
        try:
            results = self.client.submit_tasks(batch.namespace, items)
        except OrbitError as exc:
            if route_missing(exc):
                self.batch_route = False
                log.warning(
                    "the Orbit server has no batch submission route (%s); submitting rows one by one from now on "
                    "(upgrade the server for batching)",
                    exc,
                    extra={"event": "batch_route_missing"},
                )
                return [None] * len(claims)  # released: claimed again, one row per request
            status = getattr(exc, "status_code", None)
            if len(claims) > 1 and (
                isinstance(exc, OrbitUsageError)
                or status == 413
                or (status == 422 and getattr(exc, "code", None) != "idempotency_key_reused")
            ):
                # The request as a whole was refused (one row the client refuses, a body over the
                # server's limit, more items than it takes): nothing was accepted; send each row
                # alone so that only a culprit is refused.
                return self._send_each(batch, trace)
            outcome = classify_error(exc)
            if outcome.verdict is Verdict.DEAD and status == 404:
                outcome = SendOutcome(
                    verdict=Verdict.DEAD,
                    status_code=status,
                    error=(
                        f"namespace {batch.namespace!r} does not exist for the relay's API key ({exc}); if the "
                        "namespace is right, fix the key (ORBIT_API_KEY) and run `orbit-outbox retry --all-dead`; if "
                        "it is wrong, delete the rows: `orbit-outbox purge --dead-older-than 0s --row ID --reason "
                        "TEXT` (audited)"
                    ),
                )
            return [outcome] * len(claims)
        except Exception as exc:
            return [classify_error(exc)] * len(claims)
        outcomes: list[SendOutcome | None] = []
        for claim, result in zip(claims, results, strict=True):
            outcome = item_outcome(result, namespace=claim.namespace, queue=claim.queue, row_id=claim.id)
            if outcome.verdict is Verdict.DELIVERED:
                self.queues.found(claim.namespace, claim.queue)
            outcomes.append(outcome)
        return outcomes

    def _send_each(self, batch: Batch, trace: outbox_tracing.SendTrace | None) -> list[SendOutcome | None]:
        """Send the rows of ``batch`` one by one, each only while its lease allows it."""
        return [
            self._send_one(claim, trace, batch) if self.may_send(batch) else None for claim in batch.claims
        ]

    def _start_flow(self, claim: q.Claim, trace: outbox_tracing.SendTrace | None) -> SendOutcome:
        """Start the flow instance of a flow row with its key (``_flow_sending``). Outside any transaction."""
        traceparent, tracestate = (
            trace.headers(claim) if trace is not None else (claim.traceparent, claim.tracestate)
        )
        return flow_sending.start_flow(self.client, claim, traceparent, tracestate)

    def _send_one(
        self, claim: q.Claim, trace: outbox_tracing.SendTrace | None = None, batch: Batch | None = None
    ) -> SendOutcome | None:
        """Check the queue (cached), then submit one row with its key. Runs outside any transaction.

        ``None`` (released unsent) when the queue check left less of ``batch``'s lease than a send
        may take: the check is a request of its own, and a slow one would otherwise let the
        submission start after the lease (DESIGN §5: a send never starts after its row's lease).
        """
        if claim.is_flow:
            return self._start_flow(claim, trace)
        try:
            self.queues.check(claim.namespace, claim.queue)
        except OrbitError as exc:
            checked = classify_error(exc)
            if checked.verdict is Verdict.DEAD:
                return SendOutcome(
                    verdict=Verdict.DEAD,
                    status_code=checked.status_code,
                    error=(
                        f"queue {claim.queue!r} of namespace {claim.namespace!r} does not exist for the relay's "
                        f"API key ({checked.status_code} {getattr(exc, 'code', '')}, request id "
                        f"{getattr(exc, 'request_id', None) or '-'}); "
                        + dead_queue_hint(claim.namespace, claim.queue, claim.id)
                    ),
                )
            # The submission itself was not sent: whatever went wrong, the server did nothing.
            return SendOutcome(
                verdict=Verdict.NOT_SENT,
                status_code=checked.status_code,
                error=f"queue check failed, nothing was submitted: {checked.error}",
                retry_after=checked.retry_after,
                misconfigured=checked.misconfigured,
                unreachable=checked.unreachable,
                cause=checked.cause,
            )
        if batch is not None and not self.may_send(batch):
            return None
        try:
            result = self.client.submit_task(
                claim.namespace,
                claim.queue,
                claim.handler,
                claim.params,
                idempotency_key=claim.idempotency_key,
                options=claim.options,
                **_trace_args(claim, trace),
            )
        except Exception as exc:
            return classify_error(exc)
        return accepted(result)
