"""``python -m bench.chaos`` in short: orders through the whole order service while faults hit it, one real
crash of each private database among them (issue 9). The harness checks every invariant from the databases
and exits non-zero on any violation; this test also reads its JSON report.

Twice: with the Orbit server on a private MariaDB (300 orders, 30 faults), and on a private PostgreSQL
(``--server-db postgres``, issue 32: ``initdb`` into a temporary directory, its postmaster SIGKILLed and
restarted), smaller to keep ``make test`` short (150 orders, 15 faults: still every fault kind but one, and
each database crashed once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: The durability baseline each database is checked against (DESIGN §2), by the database's kind.
DURABILITY = {
    "mariadb": (("innodb_flush_log_at_trx_commit", "sync_binlog", "log_bin"), ("1", "1", "1")),
    "postgres": (("fsync", "synchronous_commit", "full_page_writes"), ("on", "on", "on")),
}


@pytest.mark.parametrize(
    ("server_db", "orders", "faults"),
    [("mariadb", 300, 30), ("postgres", 150, 15)],
    ids=["mariadb", "postgres"],
)
def test_a_short_chaos_run_keeps_every_invariant(server_db: str, orders: int, faults: int) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--orders", str(orders), "--faults", str(faults), "--seed", "7",
         "--server-db", server_db, "--json"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-8000:]}"  # stderr: the logs' evidence
    report = json.loads(done.stdout)
    assert report["server_db"] == server_db
    assert report["violations"] == [] and report["orders"] == report["acknowledged_orders"] == orders
    assert (report["lost"], report["duplicated"], report["double_charged"]) == (0, 0, 0)
    assert report["results_applied_twice"] == 0 and report["live_attempt_overlaps"] == 0
    assert report["db_crashes"] == {"business": 1, "orbit": 1}  # each server SIGKILLed and restarted
    for hooked in ("relay_between_send_and_record", "worker_between_provider_call_and_journal",
                   "consumer_between_commit_and_ack", "server_mid_transaction"):  # fmt: skip
        assert report["faults"][hooked] >= 1, report["faults"]
    assert (
        report["faults_total"] == faults
    )  # exactly as many as asked for (a hooked fault not reached is retried)
    for name, settings in report["database_settings"].items():
        kind = server_db if name == "orbit" else "mariadb"  # the business database stays a MariaDB
        keys, wanted = DURABILITY[kind]
        assert tuple(settings[k] for k in keys) == wanted, settings
    assert report["database_settings"]["orbit"]["version"].startswith("PostgreSQL") == (
        server_db == "postgres"
    )
    statuses = report["order_statuses"]
    assert statuses.get("COMPLETED", 0) > orders * 2 // 3 and sum(statuses.values()) == orders
    assert report["follow_ups"] == statuses["COMPLETED"]  # one confirmation per completed order
    assert report["tasks"] == orders + report["follow_ups"]
    assert report["drain_seconds"] > 0
