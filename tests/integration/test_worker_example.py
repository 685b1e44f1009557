"""The README's worker example runs as written against a real server, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from orbit_client import OrbitClient
from tests.conftest import DatabaseFactory
from tests.servers import run_server

REPO = Path(__file__).resolve().parents[2]


def test_worker_example_runs(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite")) as server:
        keys = server.add_namespace("shop", ("fulfilment",))
        env = {**os.environ, "ORBIT_URL": server.base_url, "ORBIT_API_KEY": keys["work"]}
        worker = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "worker_example.py")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().endswith("ready\n")
            with OrbitClient(server.base_url, api_key=keys["submit"]) as client:
                task = client.submit_task(
                    "shop",
                    "fulfilment",
                    "orders.fulfil",
                    {"order_id": 1001},
                    idempotency_key=str(uuid.uuid4()),
                ).task
                deadline = time.monotonic() + 30
                while (task := client.get_task("shop", task.id)).status != "SUCCEEDED":
                    assert time.monotonic() < deadline, task.status
                    time.sleep(0.05)
            worker.send_signal(signal.SIGTERM)
            _, stderr = worker.communicate(timeout=30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    assert worker.returncode == 0, stderr
    assert task.result == {"order_id": 1001, "reservation": "R-1001-gen1"}
