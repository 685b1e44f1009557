"""The reference order service end to end, as `make demo` runs it: real processes, a relay and a
worker SIGKILLed mid-way, on SQLite and on MariaDB. The demo's invariants are the assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DatabaseFactory

REPO = Path(__file__).resolve().parents[2]
ORDERS = 20


def run_demo(cwd: Path, *flags: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "examples.order_service.demo", "--orders", str(ORDERS), "--json", *flags],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (cwd / ".demo" / "order_service").glob("*.log")
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}\n{logs}"
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def assert_invariants(s: dict[str, Any]) -> None:
    assert s["orders_total"] == ORDERS
    assert s["orders_completed"] + s["orders_failed"] + s["orders_needs_review"] == ORDERS
    assert s["orders_pending"] == 0
    assert s["tasks_created"] == ORDERS and s["duplicate_tasks"] == 0
    assert s["faults_injected"] == 2  # the relay and the worker were each SIGKILLed once
    assert s["provider_max_per_order"] == {"reserve": 1, "charge": 1, "receipt": 1}
    assert s["completed_orders_charged_once"] is True
    assert s["provider_calls"]["charge"] >= s["orders_completed"]
    # The worker was killed after the charge and before its journal entry: the rerun asked again and was
    # answered from the provider's record, not charged twice.
    assert s["provider_requests"].get("replayed", 0) >= 1
    # The relay, worker and consumer served /metrics while the demo ran (README "Operations"), and counted.
    answered = {name for name, scrape in s["metrics"].items() if scrape["answered"]}
    assert answered == {"server", "relay", "worker", "consumer"}, s["metrics"]
    assert s["metrics"]["consumer"]["orbit_consumer_events_applied_total"] >= 1
    assert s["metrics"]["worker"]["orbit_worker_tasks_succeeded_total"] >= 1


def test_demo_on_sqlite(tmp_path: Path) -> None:
    assert_invariants(run_demo(tmp_path))


@pytest.mark.mariadb
def test_demo_on_mariadb(tmp_path: Path, make_database: DatabaseFactory) -> None:
    shop = make_database("mariadb").render_as_string(hide_password=False)
    orbit = make_database("mariadb").render_as_string(hide_password=False)
    assert_invariants(run_demo(tmp_path, "--database-url", shop, "--orbit-database-url", orbit))


@pytest.mark.mariadb
@pytest.mark.parametrize("flag", ["--database-url", "--orbit-database-url"])
def test_a_database_that_does_not_exist_is_one_line_that_says_what_to_do(
    tmp_path: Path, make_database: DatabaseFactory, flag: str
) -> None:
    """Regression (issue 10, first hour): a missing business database printed a 142-line traceback."""
    missing = make_database("mariadb").set(database="orbit_demo_missing_db")  # a server that answers
    done = subprocess.run(
        [sys.executable, "-m", "examples.order_service.demo", "--orders", "1", flag,
         missing.render_as_string(hide_password=False)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert (
        "Unknown database 'orbit_demo_missing_db'" in line and "CREATE DATABASE orbit_demo_missing_db" in line
    )
    assert len(done.stderr.strip().splitlines()) == 1
