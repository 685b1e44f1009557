"""What the benchmarks share: the MySQL server to use, the admin CLI, and real server processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

__all__ = ["MYSQL_SERVER", "cli", "orbit_servers"]

MYSQL_SERVER = os.environ.get("ORBIT_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")


def cli(*args: str, url: str) -> str:
    """Run one ``orbit-server`` admin command against ``url``; return the last line of stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "orbit_server", *args, "--database-url", url],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


@contextmanager
def orbit_servers(url: str, count: int = 1) -> Iterator[list[str]]:
    """Start ``count`` ``orbit-server serve`` processes on ``url``; yield their base URLs once all
    answer ``/readyz`` (polled: a process has no start-up signal to await); stop them on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    bases: list[str] = []
    try:
        for _ in range(count):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            bases.append(f"http://127.0.0.1:{port}")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "orbit_server",
                        "--log-level",
                        "warning",
                        "serve",
                        "--database-url",
                        url,
                        "--port",
                        str(port),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for base in bases:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{base}/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise SystemExit("server did not start") from None
                    time.sleep(0.1)
        yield bases
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
