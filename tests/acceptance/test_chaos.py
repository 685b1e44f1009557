"""``python -m bench.chaos`` in short: 300 orders through the whole order service while 30 faults hit it,
one real crash of each private MariaDB among them (issue 9). The harness checks every invariant from the
databases and exits non-zero on any violation; this test also reads its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_short_chaos_run_keeps_every_invariant() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--orders", "300", "--faults", "30", "--seed", "7", "--json"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-8000:]}"  # stderr: the logs' evidence
    report = json.loads(done.stdout)
    assert report["violations"] == [] and report["orders"] == report["acknowledged_orders"] == 300
    assert (report["lost"], report["duplicated"], report["double_charged"]) == (0, 0, 0)
    assert report["results_applied_twice"] == 0 and report["live_attempt_overlaps"] == 0
    assert report["db_crashes"] == {"business": 1, "orbit": 1}  # mariadbd SIGKILLed and restarted, each
    for hooked in ("relay_between_send_and_record", "worker_between_provider_call_and_journal",
                   "consumer_between_commit_and_ack", "server_mid_transaction"):  # fmt: skip
        assert report["faults"][hooked] >= 1, report["faults"]
    assert (
        report["faults_total"] == 30
    )  # exactly as many as asked for (a hooked fault not reached is retried)
    for settings in report["database_settings"].values():  # the durability baseline of DESIGN §2
        durability = (
            settings["innodb_flush_log_at_trx_commit"],
            settings["sync_binlog"],
            settings["log_bin"],
        )
        assert durability == ("1", "1", "1")
    statuses = report["order_statuses"]
    assert statuses.get("COMPLETED", 0) > 200 and sum(statuses.values()) == 300
    assert report["follow_ups"] == statuses["COMPLETED"]  # one confirmation per completed order
    assert report["tasks"] == 300 + report["follow_ups"]
    assert report["drain_seconds"] > 0
