"""The README's schedule example runs as written against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import DatabaseFactory
from tests.servers import run_server

REPO = Path(__file__).resolve().parents[2]


def test_schedule_example_runs(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite")) as server:
        keys = server.add_namespace("shop", ("reports",))
        env = {**os.environ, "ORBIT_URL": server.base_url, "ORBIT_API_KEY": keys["admin"]}
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "schedule_example.py")], env=env, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    nightly, ticks = done.stdout.splitlines()
    assert nightly.startswith("nightly-report-") and "next fire (UTC):" in nightly
    assert ticks.startswith("tick-") and "-> task" in ticks and ticks.endswith("WAITING")
