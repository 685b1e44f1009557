"""Run one unit of work in one short transaction: commit, roll back, or run it again on a lock conflict.

Every area's writes go through :func:`transact`, so it lives with the engine, not with any area.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_server import errors
from orbit_server.db import flow_hooks, lease_hooks
from orbit_server.db.cluster import causal_reads
from orbit_server.db.engine import is_lock_conflict

__all__ = ["transact"]

#: The logger's name is the one ``transact`` had in ``orbit_server.execution`` (log settings keep working).
log = logging.getLogger("orbit_server.execution")

#: How many times :func:`transact` runs a unit of work that met a lock conflict.
_TRIES = 5
#: Seconds: before try *n* (n >= 1) it waits a random time up to ``_PAUSE * 2**n`` (10, 20, 40, 80 ms),
#: so that two writers that met (on a Galera cluster: at certification, on two nodes) do not meet again.
_PAUSE = 0.005

P = ParamSpec("P")
T = TypeVar("T")


# ---------------------------------------------------------------- transactions


def transact(
    engine: Engine, work: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """Run ``work(conn, *args, **kwargs)`` in one transaction and commit it.

    A domain error rolls the transaction back, except one with ``keep_writes`` (e.g.
    :class:`errors.LeaseLost`, whose refusal may have expired the attempt or kept a late
    report as evidence): that is committed, then raised. After a commit (that one's too) it wakes
    what the transaction made work for (:func:`_after_commit`). A deadlock, lock wait timeout or
    :class:`errors.ConcurrentUpdate` rolls back and runs ``work`` again, up to 5 times in all,
    after a short random pause; nothing of a rolled-back try is left behind, so this is safe. On
    a Galera cluster a write on another node conflicts with this one only at ``COMMIT``
    (certification, 1213): the retries then read causally (:func:`~orbit_server.db.cluster.causal_reads`),
    so they see the transaction they lost to (README "Scaling out").

    Raises:
        errors.OrbitServerError: whatever ``work`` raised.
        errors.ConcurrentUpdate: the conflicts did not stop (409, retryable by the client).
    """
    for attempt in range(_TRIES):
        if attempt:
            time.sleep(random.uniform(0, _PAUSE * 2**attempt))
        try:
            with engine.connect() as conn:
                trans = conn.begin()
                try:
                    with causal_reads(conn, wanted=attempt > 0):
                        value = work(conn, *args, **kwargs)
                except errors.OrbitServerError as exc:
                    if exc.keep_writes:
                        trans.commit()
                        _after_commit(conn)
                    else:
                        trans.rollback()
                        lease_hooks.forget(conn)
                    raise
                except BaseException:
                    trans.rollback()
                    lease_hooks.forget(conn)
                    raise
                trans.commit()
                _after_commit(conn)
                return value
        except errors.ConcurrentUpdate:
            log.debug("concurrent update; running %s again", work.__name__)
        except sa.exc.DBAPIError as exc:
            if not is_lock_conflict(exc):
                raise
            log.debug("lock conflict; running %s again", work.__name__)
    raise errors.ConcurrentUpdate("the task kept changing under concurrent requests; retry shortly")


def _after_commit(conn: Connection) -> None:
    """Wake what the transaction just committed on ``conn`` has work for: the flow loops
    (:mod:`~orbit_server.db.flow_hooks`) and the long-polling leases of the queues it released permits in
    (:mod:`~orbit_server.db.lease_hooks`)."""
    flow_hooks.after_commit(conn)
    lease_hooks.after_commit(conn)
