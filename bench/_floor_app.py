"""The floor of ``bench.call_floor``: a minimal FastAPI app under the same uvicorn as ``orbit-server serve``.

    python -m bench._floor_app DATABASE_URL PORT

(MariaDB for ``bench.call_floor``, PostgreSQL for ``bench.pg_lease``.)

``POST /floor/{task_id}/{attempt_id}`` does what a ``start`` must write, and nothing else: one
conditional UPDATE of the task and one of its attempt, each by primary key, one INSERT of an event,
and a COMMIT, from a sync route (run in the thread pool, as Orbit's routes are), with statements
built once. ``GET /floor/ping`` touches no database (beside Orbit's ``/healthz``). No auth, no
validation of a body, no middleware: what any server doing these writes over HTTP must pay.
"""

from __future__ import annotations

import sys

import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI, Response

from orbit_server import ServerSettings
from orbit_server.api._http import uvicorn_options

_TASK = sa.text("UPDATE tasks SET state_version = state_version + 1 WHERE id = :id AND status = 'LEASED'")
_ATTEMPT = sa.text(
    "UPDATE task_attempts SET lease_seconds = lease_seconds WHERE id = :id AND status = 'LEASED'"
)
#: The event's INSERT, by database (its clock: MariaDB's, or PostgreSQL's for ``bench.pg_lease``).
_EVENT = {
    name: sa.text(
        "INSERT INTO task_events (task_id, state_version, event, from_status, to_status, actor, created_at) "
        f"VALUES (:id, 0, 'floor', 'LEASED', 'LEASED', 'floor', {clock})"
    )
    for name, clock in (("mysql", "UTC_TIMESTAMP(6)"), ("postgresql", "timezone('UTC', clock_timestamp())"))
}


def create(url: str) -> FastAPI:
    """The floor app on ``url`` (a migrated Orbit database with leased tasks)."""
    engine = sa.create_engine(url, pool_reset_on_return=None, pool_use_lifo=True)
    event = _EVENT[engine.dialect.name]
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.post("/floor/{task_id}/{attempt_id}")
    def floor(task_id: str, attempt_id: str) -> Response:
        with engine.begin() as conn:
            conn.execute(_TASK, {"id": task_id})
            conn.execute(_ATTEMPT, {"id": attempt_id})
            conn.execute(event, {"id": task_id})
        return Response(b'{"ok":true}', media_type="application/json")

    @app.get("/floor/ping")
    def ping() -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    return app


if __name__ == "__main__":
    database_url, port = sys.argv[1], int(sys.argv[2])
    uvicorn.run(create(database_url), host="127.0.0.1", port=port, log_level="warning",
                **uvicorn_options(ServerSettings(database_url=database_url)))  # fmt: skip
