"""The pipelined worker's bookkeeping, shared by :class:`Worker` and :class:`AsyncWorker` (no I/O).

DESIGN §4 "Pipelined worker". A worker holds grants in three places: in hand, waiting for a
handler slot (``waiting``); running in a slot (``running``); finished and being reported
(``reporting``). It keeps its next lease request outstanding while handlers run, so that a slot
freed by a handler is filled at once from the grants in hand, and bounds what it holds so that
**every grant it holds starts within a quarter of its lease** (:data:`START_WITHIN`):

- the grants held beyond the slots (the *prefetch*) are at most ``concurrency × ⌊W / d⌋``,
  where ``W = START_WITHIN × lease_seconds`` and ``d`` is the running mean of this worker's
  handler durations: the ``k``-th waiting grant starts after about ``⌈k / concurrency⌉ × d``
  seconds, so with this bound it starts within ``W``. Until one handler has returned, nothing
  is known and nothing is prefetched; a worker whose handlers take ``W`` or longer prefetches
  nothing and leases only for free slots. The prefetch is also capped (``prefetch_cap``,
  :func:`default_prefetch`: four times the concurrency, at least :data:`MIN_PREFETCH`), so a burst
  of short tasks never takes a queue's whole backlog into one process.
- A quarter, because the worker heartbeats every third of a lease: a grant that starts within
  a quarter of it has its first heartbeat due before half its lease is spent, leaving the other
  half for a slow answer or a retry. A waiting grant whose quarter passes anyway (a handler ran
  far longer than the mean) is **heartbeated** with the running ones, which renews its lease
  and, for a lease-and-start grant, confirms it, so that it is never left to expire.
- The worker's own view of a lease's end is conservative: the time its lease request was *sent*
  plus ``lease_seconds`` (the server's lease began after that). A grant still waiting at that
  instant is never started: it lapses on the server as a never-started attempt.

Reports count against what the worker holds (a task being reported still holds its lease), so a
server that answers reports slowly slows leasing down instead of piling up grants.

Leasing in bulk: a lease costs the server little more for eight grants than for one
(``bench.call_floor``'s "lease, one grant" and "lease, eight grants"), and with short handlers a
worker that asked again for every slot its reports freed leased one or two grants at a time. So
while the grants in hand cover every slot once more, the worker does not ask until it has room for
half its prefetch, and then asks for all the room it has; with fewer in hand it asks at once for
what it has room for. What it holds at most is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from orbit_client._attempt_models import LeaseGrant
from orbit_client._task_models import TaskStatus

__all__ = ["MIN_PREFETCH", "START_WITHIN", "Held", "Pipeline", "default_prefetch"]

#: A grant held by a worker starts within this fraction of its lease (module docstring).
START_WITHIN = 0.25
#: The least default prefetch, whatever the concurrency (:func:`default_prefetch`).
MIN_PREFETCH = 16
#: Most tasks one lease request asks for (``LeaseRequest.max_tasks``).
MAX_LEASE = 100
#: Weight of the newest handler duration in the running mean.
_SMOOTHING = 0.2


def default_prefetch(concurrency: int) -> int:
    """The default ``prefetch_cap``: four grants in hand per slot, and at least :data:`MIN_PREFETCH`.

    The floor is for few slots and short handlers. The grants in hand must last until the next
    grants arrive, and those ride on a ``complete`` batch: its linger (``report_linger``, waiting
    for the next task's report) plus its round trip, 20-40 ms on a busy server. One slot running a
    no-op handler uses a grant every 3-4 ms (its ``start``'s round trip), so four grants ran out
    first: ``bench.timeline``'s backlog round at concurrency 1 spent 62% of its wall time in the
    30% of its tasks that waited for a lease (a 3.5 ms median cycle, 151 tasks/s). Sixteen cover
    such a wait; the quarter-lease bound (module docstring) still holds fewer when handlers are slow.
    ``bench.worker_cpu``, paired with four (no-op handlers, MariaDB, load 2): 1.14× the tasks/s at
    concurrency 1 and 1.09× at 2, for 1.09× and 0.99× the server's CPU per task.
    """
    return max(4 * concurrency, MIN_PREFETCH)


@dataclass(eq=False)
class Held:
    """A grant in hand.

    Attributes:
        grant: the task and its attempt.
        started: ``True`` when the server granted it ``RUNNING`` (lease-and-start): no ``start``
            call is needed, and a first heartbeat or report confirms it.
        expires: ``time.monotonic()`` after which the lease may have lapsed (module docstring).
        start_by: ``time.monotonic()`` by which it should start; a waiting grant past it is
            heartbeated.
    """

    grant: LeaseGrant
    started: bool
    expires: float
    start_by: float
    #: Whether its slot was given back (the handler returned; the report may still be on its way).
    freed: bool = False
    #: Whether its slot counts it as confirming its start (``_in_start`` of the workers), until answered.
    confirming: bool = False

    def renewed(self, sent_at: float, lease_seconds: float) -> None:
        """A heartbeat sent at ``sent_at`` renewed it (and confirmed a lease-and-start grant)."""
        self.expires = sent_at + lease_seconds
        self.start_by = sent_at + START_WITHIN * lease_seconds


class Pipeline:
    """What a worker holds and how much more it may lease (module docstring). Not thread-safe:
    the thread :class:`Worker` calls it under its lock, :class:`AsyncWorker` from its loop."""

    def __init__(self, concurrency: int, lease_seconds: float, prefetch_cap: int) -> None:
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.prefetch_cap = prefetch_cap
        self.waiting: deque[Held] = deque()
        self.running = 0
        self.reporting = 0
        #: Reports handed off (counted in ``reporting``) that have not yet joined a batch: with the
        #: running handlers, the reports a forming ``complete``/``fail`` batch may still wait for.
        self.handing = 0
        #: Tasks asked for by the lease request outstanding (``asking``), standalone or riding on reports.
        self.asked = 0
        self.asking = False
        #: Running mean of handler durations, in seconds; ``None`` until one returned.
        self.mean: float | None = None

    def __repr__(self) -> str:
        return (
            f"Pipeline(waiting={len(self.waiting)}, running={self.running}, reporting={self.reporting}, "
            f"asked={self.asked}, prefetch={self.prefetch()})"
        )

    def may_report(self) -> int:
        """Reports that may still join a forming batch: handlers running, and reports handed off
        that have not joined one yet (``Reports``' ``busy``)."""
        return self.running + self.handing

    @property
    def held(self) -> int:
        """Grants this worker holds: waiting, running and being reported."""
        return len(self.waiting) + self.running + self.reporting

    def prefetch(self) -> int:
        """Grants it may hold beyond its slots now (module docstring)."""
        if self.mean is None:
            return 0
        window = START_WITHIN * self.lease_seconds
        rounds = int(window / self.mean) if self.mean > 0 else self.prefetch_cap
        return max(0, min(self.prefetch_cap, self.concurrency * rounds))

    def want(self, *, freeing: int = 0) -> int:
        """How many tasks to ask for now; ``freeing``: reports about to be committed by the request
        that would carry the ask (their slots are free by the time its grants arrive).

        While the grants in hand fill every slot once more, the worker leases in bulk: only once it
        has room for half its prefetch (module docstring, "Leasing in bulk"). Below that, it asks
        for whatever room it has, as it always does when nothing is prefetched."""
        prefetch = self.prefetch()
        room = self.concurrency + prefetch - (self.held - freeing) - self.asked
        if len(self.waiting) >= self.concurrency and room < prefetch // 2:
            return 0
        return max(0, min(MAX_LEASE, room))

    def observe(self, seconds: float) -> None:
        """A handler ran for ``seconds``."""
        self.mean = seconds if self.mean is None else (1 - _SMOOTHING) * self.mean + _SMOOTHING * seconds

    def hold(self, grants: list[LeaseGrant], sent_at: float) -> None:
        """Take the grants of a lease request sent at ``sent_at`` (``time.monotonic()``) in hand."""
        lease = self.lease_seconds
        for grant in grants:
            started = grant.task.status == TaskStatus.RUNNING
            self.waiting.append(Held(grant, started, sent_at + lease, sent_at + START_WITHIN * lease))

    def next(self, now: float | None = None) -> tuple[Held | None, list[Held]]:
        """The next grant to start (or ``None``), and the waiting grants whose lease may have lapsed
        (dropped: never started, they lapse on the server as never-started attempts)."""
        now = time.monotonic() if now is None else now
        lapsed: list[Held] = []
        while self.waiting:
            held = self.waiting.popleft()
            if held.expires > now:
                return held, lapsed
            lapsed.append(held)
        return None, lapsed

    def overdue(self, now: float) -> list[Held]:
        """Waiting grants past their ``start_by`` while every slot is busy: heartbeat them. (With a
        slot free, a waiting grant is being taken this instant: it needs no heartbeat.)"""
        if self.running < self.concurrency:
            return []
        return [held for held in self.waiting if held.start_by <= now]
