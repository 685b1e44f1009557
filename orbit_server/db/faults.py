"""Test-only switches of the server, read from the environment at start-up (unset in production).

**Not configuration.** These exist so that fault-injection runs (``python -m bench.chaos``)
and acceptance tests can drive a real ``orbit-server serve`` process into the situations the
design must survive. Neither is part of the documented settings.

``ORBIT_SERVER_FAULT=pause-before-commit@FILE``
    When a transaction that wrote something is about to commit and the file ``FILE`` exists,
    the file is removed, ``ORBIT_SERVER_FAULT paused-before-commit`` is written to stderr and
    the committing thread blocks for ever, holding its locks: the harness then SIGKILLs the
    process, which is the crash "in the middle of a transaction" (nothing of it is committed).
    One arming (creating the file) gives one pause.

``ORBIT_SERVER_FAULT=flow-pause@POINT@FILE``
    When the flow engine reaches the named point of an advance (:data:`FLOW_POINTS`, between
    the statements of one transaction, or just after its commit) and ``FILE`` exists, the file
    is removed, ``ORBIT_SERVER_FAULT paused-at <POINT>`` is written to stderr and the thread
    blocks for ever (holding the transaction's locks, if any): the crash tests SIGKILL the
    process there and check that a restarted one recovers (``tests/acceptance/test_flow_crashes.py``).
    One arming gives one pause.

``ORBIT_TEST_CLAIMS_WITHOUT_LOCKS=1``
    Claims (task leases, the expiry sweep, result-delivery leases) are made without
    ``FOR UPDATE SKIP LOCKED``: their select locks nothing, as on engines that parse the clause
    and ignore it (TiDB). The conditional updates that follow must keep every invariant alone
    (DESIGN §5 "Claims never rely on SKIP LOCKED alone"). The outbox relay reads the same
    variable (``outbox_adapter._queries.LOCK_CLAIMS``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

__all__ = ["CLAIMS_ENV_VAR", "ENV_VAR", "FLOW_POINTS", "LOCK_CLAIMS", "flow_point", "install", "skip_locked"]

ENV_VAR = "ORBIT_SERVER_FAULT"
CLAIMS_ENV_VAR = "ORBIT_TEST_CLAIMS_WITHOUT_LOCKS"

#: ``False`` under ``ORBIT_TEST_CLAIMS_WITHOUT_LOCKS=1``: claims lock nothing (test-only).
LOCK_CLAIMS: bool = os.environ.get(CLAIMS_ENV_VAR, "").strip().lower() not in ("1", "true", "yes")

S = TypeVar("S", bound=sa.Select[Any])

#: The named points of a flow advance where ``flow-pause@POINT@FILE`` can stop a server (test-only):
#: an event or timer claimed, the token moved, a step's task inserted, its step row inserted, the
#: transaction about to commit, and just after the commit.
FLOW_POINTS = ("claimed", "token-moved", "task-inserted", "step-inserted", "before-commit", "after-commit")


def _flow_fault() -> tuple[str, str] | None:
    value = os.environ.get(ENV_VAR, "").strip()
    if not value.startswith("flow-pause@"):
        return None
    _, point, gate = value.split("@", 2) if value.count("@") >= 2 else (value, "", "")
    if point not in FLOW_POINTS or not gate:
        raise ValueError(
            f"{ENV_VAR}={value!r}: use flow-pause@POINT@FILE with POINT one of {', '.join(FLOW_POINTS)}"
        )
    return point, gate


_FLOW_FAULT = _flow_fault()


def flow_point(point: str) -> None:
    """A named point of a flow advance: nothing, unless ``flow-pause@<point>@FILE`` is set and armed."""
    if _FLOW_FAULT is None or _FLOW_FAULT[0] != point:
        return
    try:
        os.remove(_FLOW_FAULT[1])  # atomic: of concurrent advances, exactly one takes the arming
    except FileNotFoundError:
        return
    sys.stderr.write(f"{ENV_VAR} paused-at {point}\n")
    sys.stderr.flush()
    threading.Event().wait()  # until the process is killed


def skip_locked(stmt: S) -> S:
    """``stmt`` with ``FOR UPDATE SKIP LOCKED``, or unchanged when claims lock nothing (test-only)."""
    return stmt.with_for_update(skip_locked=True) if LOCK_CLAIMS else stmt


def install(engine: Engine) -> None:
    """Install the hook named by ``ORBIT_SERVER_FAULT`` on ``engine`` (nothing when unset).

    Raises:
        ValueError: an unknown hook (a typo must not silently test nothing).
    """
    if not LOCK_CLAIMS:
        logging.getLogger("orbit_server").warning(
            "%s is set: claims take no FOR UPDATE SKIP LOCKED (a test-only switch; never in production)",
            CLAIMS_ENV_VAR,
        )
    value = os.environ.get(ENV_VAR, "").strip()
    if not value or _FLOW_FAULT is not None:
        return
    name, _, gate = value.partition("@")
    if name != "pause-before-commit" or not gate:
        raise ValueError(f"{ENV_VAR}={value!r} is not a known fault hook (pause-before-commit@FILE)")
    key = "orbit_fault_wrote"

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _mark(conn: sa.Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        if not conn.invalidated and statement.lstrip()[:6].upper() in ("INSERT", "UPDATE", "DELETE"):
            conn.info[key] = True

    @sa.event.listens_for(engine, "rollback")
    def _clear(conn: sa.Connection) -> None:
        if not conn.invalidated:  # an invalidated connection is discarded (and its info unreachable)
            conn.info.pop(key, None)

    @sa.event.listens_for(engine, "commit")
    def _pause(conn: sa.Connection) -> None:
        if conn.invalidated or not conn.info.pop(key, False):
            return
        try:
            os.remove(gate)  # atomic: of concurrent transactions, exactly one takes the arming
        except FileNotFoundError:
            return
        sys.stderr.write(f"{ENV_VAR} paused-before-commit\n")
        sys.stderr.flush()
        threading.Event().wait()  # until the process is killed
