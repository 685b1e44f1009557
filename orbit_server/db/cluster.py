"""What a MariaDB Galera cluster needs from the server, and nothing on any other database (README "Scaling out").

A Galera node answers reads from what it has applied, which may be a moment behind a commit made on
another node. Most of Orbit's decisions need no more: a later unique index or conditional ``UPDATE``
decides, and certification refuses the loser at ``COMMIT`` (1213, run again by
:func:`orbit_server.db.transact.transact`). A few reads decide by themselves, where "not found"
would refuse a request for good (an API key, a queue, a submission looked up by key) or where a
retry must see the transaction it lost to: those run under :func:`causal_reads`
(``wsrep_sync_wait=1``: the read waits until the node has applied every write set the cluster
ordered before it).

:func:`node_state` says whether the node can serve at all: a node outside the primary component
refuses every statement that touches a table (1047), while ``SELECT 1`` still answers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

__all__ = ["causal_reads", "is_galera", "node_state", "reset_on_return"]

#: In a pooled connection's info while its session may still wait on reads (``wsrep_sync_wait = 1``).
_CAUSAL = "orbit_causal_reads"
#: Per engine: whether its database is a Galera node (``@@wsrep_on``), asked once.
_GALERA: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def is_galera(conn: Connection) -> bool:
    """Whether ``conn`` talks to a Galera node with replication on (asked once per engine; never
    on SQLite or PostgreSQL; MySQL, which has no ``wsrep_on``, answers no)."""
    if conn.dialect.name != "mysql":
        return False
    engine = conn.engine
    found = _GALERA.get(engine)
    if found is None:
        try:
            value = conn.exec_driver_sql("SELECT @@wsrep_on").scalar()
        except sa.exc.DBAPIError as exc:  # MySQL: 1193 unknown system variable (the transaction goes on)
            if getattr(exc.orig, "args", (None,))[0] != 1193:
                raise
            value = 0
        found = _GALERA[engine] = str(value).upper() in ("1", "ON")
    return found


@contextlib.contextmanager
def causal_reads(conn: Connection, *, wanted: bool = True) -> Iterator[Connection]:
    """Until the block ends, a transaction's first read on ``conn`` first waits until its node has
    applied every transaction the cluster committed before the read began (``SET SESSION
    wsrep_sync_wait = 1``). Enter it before the transaction's first statement: MariaDB waits only
    at the start of a transaction, never inside one (the later reads of a READ COMMITTED
    transaction see at least what the first one waited for).

    Nothing at all off Galera or when not ``wanted``. The wait is bounded by the provider's
    ``repl.causal_read_timeout`` (then 1205, a lock conflict: the caller's retry applies). The
    session is set back to 0 at the end, or, after an error, when the connection returns to the
    pool (:func:`reset_on_return`), so no pooled connection keeps waiting on every read.
    """
    if not wanted or not is_galera(conn):
        yield conn
        return
    conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
    info = conn.connection.info
    info[_CAUSAL] = True
    yield conn
    # Not after an error: the caller's error (a conflict to retry, say) must reach it unchanged,
    # and the pool sets the session back when the connection returns (reset_on_return). An error
    # of this statement is raised, never swallowed: after a brute-force abort (another node's write
    # won) it is the one report of it, and the COMMIT that follows would succeed with nothing in it.
    conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")
    info.pop(_CAUSAL, None)


def reset_on_return(engine: Engine) -> None:
    """On a MySQL/MariaDB ``engine``: learn at its first connection whether it is a Galera node, and
    set a connection whose :func:`causal_reads` ended in an error back to ``wsrep_sync_wait = 0``
    when it returns to the pool (the pool discards it if that fails)."""

    @sa.event.listens_for(engine, "first_connect")
    def _learn(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT @@wsrep_on")
            row = cursor.fetchone()
            _GALERA[engine] = row is not None and str(row[0]).upper() in ("1", "ON")
        except engine.dialect.loaded_dbapi.Error:  # MySQL: no such variable
            _GALERA[engine] = False
        finally:
            cursor.close()

    @sa.event.listens_for(engine, "reset")
    def _reset(dbapi_connection: Any, record: Any, state: Any) -> None:
        if state.terminate_only or not record.info.pop(_CAUSAL, False):
            return
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SET SESSION wsrep_sync_wait = 0")
        finally:
            cursor.close()


def node_state(conn: Connection) -> str | None:
    """``None`` when the database can serve; else why not, for ``/readyz``: a Galera node that is
    not ready (outside the primary component) or not ``Synced`` (joining, donor, desynced)."""
    if not is_galera(conn):
        return None
    status: dict[str, str] = dict(
        conn.exec_driver_sql(
            "SHOW STATUS WHERE Variable_name IN ('wsrep_ready', 'wsrep_local_state_comment', 'wsrep_cluster_status')"
        ).all()
    )
    if status.get("wsrep_ready") != "ON" or status.get("wsrep_cluster_status") != "Primary":
        return f"the database node is not in its cluster's primary component (wsrep_cluster_status={status.get('wsrep_cluster_status')})"
    if status.get("wsrep_local_state_comment") != "Synced":
        return f"the database node is not synced with its cluster (wsrep_local_state_comment={status.get('wsrep_local_state_comment')})"
    return None
