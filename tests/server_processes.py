"""``orbit-server serve`` as a real child process (SIGKILL-able), for the flow crash and load tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
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


#: Seconds a server process may take to answer ``/readyz``: as patient as the benchmarks
#: (``bench._support``). On a 2-core machine at load 8-9 a start-up took 37 s once, and tests that gave
#: 30 s failed with "server did not start".
START_TIMEOUT = 120.0


def await_ready(
    base_url: str,
    proc: subprocess.Popen[Any],
    *,
    timeout: float = START_TIMEOUT,
    output: Callable[[], str] | None = None,
) -> None:
    """Poll ``base_url/readyz`` until it answers 200 (a process has no start-up signal to await).

    Raises:
        AssertionError: ``proc`` exited, or ``timeout`` seconds passed; with ``output()`` (its log).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base_url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}:\n{output() if output else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not start within {timeout:g} s:\n{output() if output else ''}")
        time.sleep(0.05)


class ServerProcess:
    """One server process; its stderr (and stdout) go to ``log``.

    Ready when constructed. One that does not get ready is killed and its log closed before the
    error is raised, so nothing of it outlives the test (a leaked process and open log made the next
    test on that xdist worker fail with "unraisable exception" warnings).
    """

    def __init__(self, url: URL, log: Path, **env: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = log.open("w")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orbit_server", "serve", "--database-url", url.render_as_string(False),
                 "--port", str(self.port)],
                stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, "ORBIT_LOG_LEVEL": "warning", **env},
            )  # fmt: skip
        except BaseException:
            self._out.close()
            raise
        try:
            await_ready(self.base_url, self.proc, output=lambda: self.output()[-3000:])
        except BaseException:
            self.close()
            raise

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

    def close(self) -> None:
        """Kill the process if it still runs and close its log; idempotent (a test's last resort)."""
        if self.proc.poll() is None:
            self.proc.kill()
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


@pytest.fixture
def server_processes() -> Iterator[Callable[..., ServerProcess]]:
    """``spawn(url, log, **env)`` → a ready :class:`ServerProcess`; every one it made is killed (if still
    running) and its log closed when the test ends, on every path."""
    made: list[ServerProcess] = []

    def spawn(url: URL, log: Path, **env: str) -> ServerProcess:
        server = ServerProcess(url, log, **env)
        made.append(server)
        return server

    yield spawn
    for server in made:
        server.close()
