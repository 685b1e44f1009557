"""The README's outbox example runs as written, on each business database, against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.conftest import DatabaseFactory
from tests.integration.outbox.conftest import Biz
from tests.servers import run_server

REPO = Path(__file__).resolve().parents[3]


def test_outbox_example_runs(biz: Biz, make_database: DatabaseFactory, tmp_path: Path) -> None:
    with run_server(make_database("sqlite")) as orbit:  # its own server: the example's keys are fixed
        keys = orbit.add_namespace("shop", ("fulfilment",))
        env = {
            **os.environ,
            "ORBIT_URL": orbit.base_url,
            "ORBIT_API_KEY": keys["submit"],
            "ORBIT_OUTBOX_DATABASE_URL": biz.url.render_as_string(hide_password=False),
        }
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "outbox_example.py")],
            env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    row_id, key, task_id, delivered = done.stdout.split()
    # The default key: a UUID that no later database can hand out again (an order id would repeat).
    assert int(row_id) >= 1 and uuid.UUID(key) and uuid.UUID(task_id) and delivered == "1"
