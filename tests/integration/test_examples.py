"""The README's client example runs as written against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.conftest import DatabaseFactory
from tests.servers import run_server

REPO = Path(__file__).resolve().parents[2]


def test_client_example_runs(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite")) as server:
        keys = server.add_namespace("shop", ("fulfilment",))
        env = {**os.environ, "ORBIT_URL": server.base_url, "ORBIT_API_KEY": keys["submit"]}
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "client_example.py")], env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    task_id, status, how = done.stdout.split()
    assert uuid.UUID(task_id) and status == "WAITING" and how == "new"


def test_client_example_says_a_refused_key_needs_fixing_not_a_later_try(
    make_database: DatabaseFactory,
) -> None:
    """Issue 30: on a 401 it printed "safe to try again later"."""
    with run_server(make_database("sqlite")) as server:
        server.add_namespace("shop", ("fulfilment",))
        env = {**os.environ, "ORBIT_URL": server.base_url, "ORBIT_API_KEY": "orbit_wrong"}
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "client_example.py")], env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
    assert done.returncode != 0 and "AuthenticationError" in done.stderr
    assert "try again later" not in done.stdout and "fix the cause" in done.stdout, done.stdout
