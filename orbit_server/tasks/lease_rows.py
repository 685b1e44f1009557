"""What both lease paths read: the queue's row as a lease finds it (:class:`_QueueRow`; its columns named
:data:`_QUEUE_INFO` in a statement that also returns task rows) and a task row's place in lease order
(:func:`_lease_order`).

Shared by :mod:`.leases` (the lease of every database) and :mod:`.postgres_leases` (PostgreSQL's
autocommitted lease, which :mod:`.leases` dispatches to), apart from both so that neither imports the other
for them: no import circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

#: The names of the queue row's columns (:class:`_QueueRow`'s fields, in order) in a statement that also
#: returns other columns (``NULL`` in its task rows): :func:`.leases._find_queue_and_claim_statement`,
#: :data:`.postgres_leases._PG_PROBE` and :func:`.postgres_leases._pg_claim_statement`.
_QUEUE_INFO = ("q_id", "q_namespace", "q_now", "q_paused", "q_per_key", "q_max", "q_sweep_due")


class _QueueRow(NamedTuple):
    id: int
    name: str
    db_now: Any
    paused: Any
    max_concurrency_per_key: int | None
    max_concurrency: int | None
    sweep_due: Any


def _lease_order(row: Mapping[Any, Any]) -> tuple[int, datetime, str]:
    """A task row's place in lease order (:data:`~orbit_server.tasks.permits.LEASE_ORDER`)."""
    return -row["priority"], row["available_at"], row["id"]
