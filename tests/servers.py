"""A real Orbit server on a free port, run by uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from sqlalchemy.engine import URL, Engine

from orbit_server import ServerSettings, create_app
from orbit_server.api._http import uvicorn_options
from orbit_server.db import migrate
from orbit_server.db.engine import create_engine, dispose_when_returned
from orbit_server.tasks import store


@dataclass
class RunningServer:
    base_url: str
    engine: Engine
    database_url: URL
    keys: dict[str, str] = field(default_factory=dict)

    def add_namespace(self, namespace: str, queues: tuple[str, ...] = ("default",)) -> dict[str, str]:
        """Create a namespace, its queues and one key per role; return the keys by role."""
        keys = {}
        with self.engine.begin() as conn:
            store.create_namespace(conn, namespace)
            for queue in queues:
                store.create_queue(conn, namespace, queue)
            for role in store.ROLES:
                keys[role] = store.create_api_key(conn, namespace, role)
        return keys


@contextmanager
def run_server(database_url: URL, **settings: object) -> Iterator[RunningServer]:
    """Migrate ``database_url``, serve it on 127.0.0.1:<free port>, stop on exit.

    The listening socket is bound before uvicorn starts, so a request sent at once
    waits in the backlog instead of racing the start-up.
    """
    engine = create_engine(database_url, pool_size=40)
    migrate.upgrade(engine)
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; with proto 0
    # every keep-alive response waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    server_settings = ServerSettings(database_url=database_url.render_as_string(False), **settings)  # type: ignore[arg-type]
    app = create_app(server_settings, engine=engine)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            limit_concurrency=1000,
            **uvicorn_options(server_settings),
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield RunningServer(base_url=f"http://127.0.0.1:{port}", engine=engine, database_url=database_url)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        # Only once every connection is back: one returned to a disposed pool stays open until the garbage
        # collector closes it, and psycopg's ResourceWarning then fails whatever test is running.
        dispose_when_returned(engine)
