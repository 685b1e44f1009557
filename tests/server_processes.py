"""``orbit-server serve`` as a real child process (SIGKILL-able), for the flow crash and load tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy.engine import URL

from bench.chaos.mariadb import free_port
from orbit_server.db import migrate as _migrate
from orbit_server.db.engine import create_engine
from orbit_server.tasks import store


def prepare(url: URL, namespace: str, queues: tuple[str, ...]) -> dict[str, str]:
    """Migrate the database, create a namespace with its queues and one key per role."""
    engine = create_engine(url, pool_size=2)
    try:
        _migrate.upgrade(engine)
        with engine.begin() as conn:
            store.create_namespace(conn, namespace)
            for queue in queues:
                store.create_queue(conn, namespace, queue)
            return {role: store.create_api_key(conn, namespace, role) for role in store.ROLES}
    finally:
        engine.dispose()


class ServerProcess:
    """One server process; its stderr (and stdout) go to ``log``."""

    def __init__(self, url: URL, log: Path, **env: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orbit_server", "serve", "--database-url", url.render_as_string(False),
             "--port", str(self.port)],
            stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, "ORBIT_LOG_LEVEL": "warning", **env},
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:  # no start-up signal to await: poll readiness with a deadline
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"{text!r} never appeared:\n{self.output()[-3000:]}"
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no commit of whatever was in flight."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._out.close()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._out.close()
        return self.log.read_text()
