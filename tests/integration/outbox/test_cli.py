"""``orbit-outbox`` through click's CliRunner, on each database, against a real server."""

from __future__ import annotations

import json
import uuid
from typing import Any

from click.testing import CliRunner, Result

from outbox_adapter import OutboxTables, enqueue
from outbox_adapter.cli import main
from tests.integration.outbox.conftest import Biz, Namespace
from tests.outbox_support import closed_port
from tests.servers import RunningServer


def _run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_cli_migrates_relays_inspects_retries_reconciles_and_purges(
    biz: Biz, ns: Namespace, orbit: RunningServer
) -> None:
    table = f"cli_{uuid.uuid4().hex[:8]}"
    url = biz.url.render_as_string(hide_password=False)
    db = ["--database-url", url, "--table", table]
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["submit"], "ORBIT_OUTBOX_BACKOFF_BASE": "0"}

    assert _run("status", *db).exit_code == 3  # not migrated yet: exit 3, and the message names the fix
    assert "orbit-outbox migrate" in _run("status", *db).stderr
    assert _run("migrate", *db).exit_code == 0

    tables = OutboxTables(name=table)
    with biz.engine.begin() as conn:
        good = enqueue(conn, namespace=ns.name, queue="default", handler="h", params={"secret": "s3cr3t"},
                       tables=tables)  # fmt: skip
        dead = enqueue(conn, namespace=ns.name, queue="missing", handler="h", params={}, tables=tables)

    stats = _json(_run("relay", *db, "--once", "--json", env=env))
    assert (stats["delivered"], stats["dead"]) == (1, 1)

    status = _json(_run("status", *db, "--json"))
    assert status["counts"] == {"PENDING": 0, "DELIVERED": 1, "DEAD": 1, "NEEDS_RECONCILE": 0}
    assert status["oldest_pending_age_seconds"] is None

    listed = _json(_run("list", *db, "--state", "DEAD", "--json"))
    assert [r["id"] for r in listed] == [dead.id] and "params" not in listed[0]
    shown = _json(_run("show", *db, str(good.id), "--json"))
    assert (
        shown["row"]["state"] == "DELIVERED"
        and "params" not in shown["row"]
        and "lease_token" not in shown["row"]
    )
    assert [e["to_state"] for e in shown["events"]] == ["DELIVERED"]
    assert "s3cr3t" not in _run("show", *db, str(good.id)).stdout
    assert _json(_run("show", *db, str(good.id), "--params", "--json"))["row"]["params"] == {
        "secret": "s3cr3t"
    }

    refused = _run("retry", *db, str(good.id))
    assert refused.exit_code == 1 and f"row {good.id} is DELIVERED" in refused.stderr
    assert _run("retry", *db, "424242").exit_code == 1
    assert _run("retry", *db).exit_code == 2  # neither an id nor --all-dead
    assert _json(_run("retry", *db, "--all-dead", "--actor", "ops:test", "--json")) == {"retried": [dead.id]}
    shown = _json(_run("show", *db, str(dead.id), "--json"))
    assert shown["row"]["state"] == "PENDING" and shown["events"][-1]["actor"] == "ops:test"

    assert _json(_run("reconcile", *db, "--dry-run", "--json", env=env)) == []
    assert _json(_run("purge", *db, "--delivered-older-than", "0s", "--json")) == {"deleted": 1}
    assert _run("purge", *db, "--delivered-older-than", "a week").exit_code == 2
    assert _json(_run("status", *db, "--json"))["counts"]["DELIVERED"] == 0

    table_out = _run("status", *db)
    assert table_out.exit_code == 0 and "PENDING" in table_out.stdout


def test_reconcile_exit_codes_and_unreachable_services(biz: Biz, ns: Namespace, orbit: RunningServer) -> None:
    table = f"cli_{uuid.uuid4().hex[:8]}"
    url = biz.url.render_as_string(hide_password=False)
    db = ["--database-url", url, "--table", table]
    assert _run("migrate", *db).exit_code == 0
    tables = OutboxTables(name=table)
    with biz.engine.begin() as conn:
        row = enqueue(conn, namespace=ns.name, queue="default", handler="h", params={}, tables=tables)
        conn.execute(tables.outbox.update().values(state="NEEDS_RECONCILE"))
    unreachable = {"ORBIT_URL": f"http://127.0.0.1:{closed_port()}", "ORBIT_API_KEY": ns.keys["read"]}
    failed = _run("reconcile", *db, "--timeout", "2", env=unreachable)
    assert failed.exit_code == 4 and "lookup failed" in failed.stdout
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["read"]}
    decided = _json(_run("reconcile", *db, "--json", env=env))
    assert [(d["row_id"], d["decision"], d["applied"]) for d in decided] == [(row.id, "pending", True)]


def test_help_shows_the_environment_variables_and_bad_urls_are_usage_errors() -> None:
    relay_help = _run("relay", "--help").stdout
    for var in ("ORBIT_OUTBOX_DATABASE_URL", "ORBIT_URL", "ORBIT_API_KEY", "ORBIT_OUTBOX_BATCH_SIZE"):
        assert var in relay_help
    assert _run("status", "--database-url", "nonsense://").exit_code == 2
    down = _run("status", "--database-url", f"mysql+pymysql://root@127.0.0.1:{closed_port()}/x")
    assert down.exit_code == 3 and "may be down" in down.stderr
