"""``orbit-outbox`` through click's CliRunner, on each database, against a real server."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from click.testing import CliRunner, Result

from orbit_client import OrbitClient
from outbox_adapter import Outbox, OutboxTables, enqueue
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
    assert status["counts"] == {"PENDING": 0, "DELIVERED": 1, "DEAD": 1, "NEEDS_RECONCILE": 0, "ABANDONED": 0}
    assert status["oldest_pending_age_seconds"] is None

    listed = _json(_run("list", *db, "--state", "DEAD", "--json"))
    assert [r["id"] for r in listed] == [dead.id] and "params" not in listed[0]
    assert _json(_run("list", *db, "--state", "dead", "--json")) == listed  # any case
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


def test_a_mistyped_queues_dead_row_names_both_ways_out_and_is_purged_audited(
    biz: Biz, ns: Namespace, orbit: RunningServer
) -> None:
    """Regression (issue 10, first hour): the hint said only to create the mistyped queue, and a DEAD
    row could be neither abandoned nor purged."""
    table = f"cli_{uuid.uuid4().hex[:8]}"
    url = biz.url.render_as_string(hide_password=False)
    db = ["--database-url", url, "--table", table]
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["submit"]}
    assert _run("migrate", *db).exit_code == 0
    tables = OutboxTables(name=table)
    with biz.engine.begin() as conn:
        typo = enqueue(conn, namespace=ns.name, queue="defualt", handler="h", params={}, tables=tables)
        other = enqueue(conn, namespace=ns.name, queue="missing", handler="h", params={}, tables=tables)
    assert _json(_run("relay", *db, "--once", "--json", env=env))["dead"] == 2
    hint = _json(_run("show", *db, str(typo.id), "--json"))["row"]["last_error"]
    assert f"orbit-server queue create {ns.name} defualt" in hint and f"orbit-outbox retry {typo.id}" in hint
    assert f"orbit-outbox purge --dead-older-than 0s --row {typo.id} --reason" in hint

    assert _run("purge", *db).exit_code == 2  # neither age
    assert _run("purge", *db, "--dead-older-than", "0s").exit_code == 2  # no reason
    assert _run("purge", *db, "--row", str(typo.id), "--reason", "x").exit_code == 2  # --row needs the age
    assert _json(_run("purge", *db, "--dead-older-than", "1h", "--reason", "typo", "--json")) == {
        "deleted": 0,
        "dead": [],
    }  # both went DEAD just now
    purged = _run("purge", *db, "--dead-older-than", "0s", "--row", str(typo.id), "--reason", "mistyped queue",
                  "--actor", "ops:alice", "--json")  # fmt: skip
    assert _json(purged) == {"deleted": 1, "dead": [typo.id]}
    assert _run("show", *db, str(typo.id)).exit_code == 1  # the row is gone ...
    outbox = Outbox(biz.engine, tables=tables)
    last = outbox.events(typo.id)[-1]  # ... its audit trail is not
    assert (last.from_state, last.to_state, last.actor, last.reason) == (
        "DEAD",
        "PURGED",
        "ops:alice",
        "mistyped queue",
    )
    assert [e.to_state for e in outbox.events(typo.id)] == ["DEAD", "PURGED"]
    assert outbox.get(other.id).state == "DEAD"  # --row kept the purge to that row
    plain = _run("purge", *db, "--dead-older-than", "0s", "--reason", "gone", "--delivered-older-than", "7d")
    assert plain.exit_code == 0 and f"deleted 1 DEAD row(s): {other.id}" in plain.stdout
    assert _json(_run("status", *db, "--json"))["counts"]["DEAD"] == 0


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


def test_relay_once_exits_4_when_orbit_is_unreachable_or_refuses_the_key(
    biz: Biz, ns: Namespace, orbit: RunningServer
) -> None:
    table = f"cli_{uuid.uuid4().hex[:8]}"
    db = ["--database-url", biz.url.render_as_string(hide_password=False), "--table", table]
    assert _run("migrate", *db).exit_code == 0
    with biz.engine.begin() as conn:
        row = enqueue(
            conn, namespace=ns.name, queue="default", handler="h", params={}, tables=OutboxTables(name=table)
        )
    unreachable = {"ORBIT_URL": f"http://127.0.0.1:{closed_port()}", "ORBIT_API_KEY": ns.keys["submit"]}
    failed = _run(
        "relay",
        *db,
        "--once",
        "--json",
        "--timeout",
        "2",
        env={**unreachable, "ORBIT_OUTBOX_BACKOFF_BASE": "0"},
    )
    assert failed.exit_code == 4, failed.output
    assert json.loads(failed.stdout)["orbit_unavailable"] == 1
    assert "1 due row(s) were not delivered" in failed.stderr and "ORBIT_API_KEY" in failed.stderr
    assert _json(_run("show", *db, str(row.id), "--json"))["row"]["state"] == "PENDING"
    # A refused key is a configuration error: with --once or without, the relay stops and exits 4,
    # naming the key by its first characters and the fix; the row keeps its attempts.
    for key in ("orbit_not-a-key", ns.keys["read"]):  # 401, and 403: the wrong role
        env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": key}
        for once in (["--once"], []):
            failed = _run("relay", *db, *once, "--timeout", "2", env=env)
            assert failed.exit_code == 4, (key, once, failed.output)
            assert f"refused the relay's API key {key[:12]}…" in failed.stderr, failed.stderr
            assert "api-key create" in failed.stderr and "ORBIT_API_KEY" in failed.stderr
            assert key not in failed.stderr
            shown = _json(_run("show", *db, str(row.id), "--json"))["row"]
            assert (shown["state"], shown["attempts"]) == ("PENDING", 0)
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["submit"], "ORBIT_OUTBOX_BACKOFF_BASE": "0"}
    with biz.engine.begin() as conn:  # a row the server refuses for good still lets the run exit 0
        enqueue(
            conn, namespace=ns.name, queue="missing", handler="h", params={}, tables=OutboxTables(name=table)
        )
    stats = _json(_run("relay", *db, "--once", "--json", env=env))
    assert (stats["delivered"], stats["dead"], stats["orbit_unavailable"]) == (1, 1, 0)


def test_resolve_settles_rows_reconcile_leaves_for_a_person(
    biz: Biz, ns: Namespace, orbit: RunningServer
) -> None:
    table = f"cli_{uuid.uuid4().hex[:8]}"
    db = ["--database-url", biz.url.render_as_string(hide_password=False), "--table", table]
    assert _run("migrate", *db).exit_code == 0
    tables = OutboxTables(name=table)
    with biz.engine.begin() as conn:
        rows = [
            enqueue(conn, namespace=ns.name, queue="default", handler="h", params={}, tables=tables)
            for _ in range(2)
        ]
    with OrbitClient(orbit.base_url, api_key=ns.keys["submit"]) as client:
        task = client.submit_task(ns.name, "other", "h", {}, idempotency_key=f"k-{uuid.uuid4()}").task
        for row in rows:  # the server already has tasks of a different submission under the rows' keys
            client.submit_task(ns.name, "other", "someone.else", {}, idempotency_key=row.idempotency_key)
    with biz.engine.begin() as conn:
        conn.execute(tables.outbox.update().values(state="NEEDS_RECONCILE"))
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["read"]}

    left = _run("reconcile", *db, env=env)
    assert left.exit_code == 1
    # Piped, stdout is the decisions' lines alone: the summary goes to stderr with the hint.
    assert "2 row(s) looked up: 0 decided, 2 left for a person, 0 lookup(s) failed" in left.stderr
    assert [line.split("\t")[2] for line in left.stdout.splitlines()] == ["decision", "mismatch", "mismatch"]
    assert "orbit-outbox resolve ID --delivered-as" in left.stderr
    decided = json.loads(_run("reconcile", *db, "--json", env=env).stdout)
    assert [(d["decision"], d["applied"]) for d in decided] == [("mismatch", False)] * 2

    first, second = rows
    unknown = _run("resolve", *db, str(first.id), "--delivered-as", "no-such-task", "--reason", "r", env=env)
    assert unknown.exit_code == 1 and "no task 'no-such-task'" in unknown.stderr
    assert _run("resolve", *db, str(first.id), "--reason", "r").exit_code == 2  # neither action
    assert (
        _run("resolve", *db, str(first.id), "--delivered-as", task.id, "--reason", "r").exit_code == 2
    )  # no URL
    resolved = _json(
        _run("resolve", *db, str(first.id), "--delivered-as", task.id, "--reason", "seen in the queue",
             "--actor", "ops:alice", "--json", env=env)
    )  # fmt: skip
    assert (resolved["state"], resolved["orbit_task_id"]) == ("DELIVERED", task.id)
    abandoned = _run(
        "resolve", *db, str(second.id), "--abandon", "--reason", "order [cancelled]", "--actor", "ops:bob"
    )
    assert abandoned.exit_code == 0 and "abandoned by operator: order [cancelled]" in abandoned.stdout
    again = _run("resolve", *db, str(second.id), "--abandon", "--reason", "again")
    assert again.exit_code == 1 and f"row {second.id} is ABANDONED, not NEEDS_RECONCILE" in again.stderr
    for row, actor, to_state in ((first, "ops:alice", "DELIVERED"), (second, "ops:bob", "ABANDONED")):
        event = _json(_run("show", *db, str(row.id), "--json"))["events"][-1]
        assert (event["from_state"], event["to_state"], event["actor"]) == (
            "NEEDS_RECONCILE",
            to_state,
            actor,
        )
    assert _json(_run("reconcile", *db, "--json", env=env)) == []


def test_help_shows_the_environment_variables_and_bad_urls_are_usage_errors() -> None:
    relay_help = _run("relay", "--help").stdout
    for var in ("ORBIT_OUTBOX_DATABASE_URL", "ORBIT_URL", "ORBIT_API_KEY", "ORBIT_OUTBOX_BATCH_SIZE"):
        assert var in relay_help
    helps = {cmd: " ".join(_run(cmd, "--help").stdout.split()) for cmd in ("relay", "reconcile", "consume")}
    assert "(submit role)" in helps["relay"] and "(read role)" in helps["reconcile"]
    assert "(work role)" in helps["consume"]
    no_driver = _run(
        "status", "--database-url", "mysql+mysqlconnector://app@127.0.0.1/shop"
    )  # mysql-connector is not installed (mysqlclient, MySQLdb, is: the server's C driver extra)
    assert (
        no_driver.exit_code == 2
        and "install 'orbit-tasks[mysql]' or 'orbit-tasks[postgres]'" in no_driver.stderr
    )
    assert _run("status", "--database-url", "nonsense://").exit_code == 2
    down = _run("status", "--database-url", f"mysql+pymysql://root@127.0.0.1:{closed_port()}/x")
    assert down.exit_code == 3 and "may be down" in down.stderr


def test_list_piped_is_tab_separated_with_a_header_and_a_delivered_row_has_no_due_time(
    biz: Biz, ns: Namespace, orbit: RunningServer
) -> None:
    """Issue 23: piped, `list` printed a rich table wrapped at 80 columns; a DELIVERED row showed an "available
    at" in the future (the backoff of a send that then succeeded)."""
    table = f"cli_{uuid.uuid4().hex[:8]}"
    db = ["--database-url", biz.url.render_as_string(hide_password=False), "--table", table]
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["submit"]}
    assert _run("migrate", *db).exit_code == 0
    tables = OutboxTables(name=table)
    with biz.engine.begin() as conn:
        sent = enqueue(
            conn, namespace=ns.name, queue="default", handler="orders.fulfil", params={}, tables=tables
        )
        waiting = enqueue(conn, namespace=ns.name, queue="default", handler="orders.ship", params={}, tables=tables,
                          available_at=datetime(2099, 1, 1, tzinfo=UTC))  # fmt: skip
    assert _json(_run("relay", *db, "--once", "--json", env=env))["delivered"] == 1
    listed = _run("list", *db)
    assert listed.exit_code == 0, listed.output
    header, *lines = listed.stdout.splitlines()
    columns = header.split("\t")
    assert columns[:3] == ["id", "state", "key"] and "available at (UTC)" in columns
    rows = {int(line.split("\t")[0]): dict(zip(columns, line.split("\t"), strict=True)) for line in lines}
    assert set(rows) == {sent.id, waiting.id}
    assert rows[sent.id]["state"] == "DELIVERED" and rows[sent.id]["available at (UTC)"] == ""
    assert rows[sent.id]["key"] == sent.idempotency_key  # whole, never cut or wrapped
    assert rows[waiting.id]["available at (UTC)"].startswith("2099-01-01")


def test_huge_ids_and_durations_long_actors_and_a_missing_directory_are_usage_errors(
    biz: Biz, tmp_path: Any
) -> None:
    """Issue 30: each of these printed a traceback, and a SQLite file in a directory that does not exist
    was reported as a database that 'may be down or busy'."""
    table = f"cli_{uuid.uuid4().hex[:8]}"
    db = ["--database-url", biz.url.render_as_string(hide_password=False), "--table", table]
    assert _run("migrate", *db).exit_code == 0
    big = str(2**63)
    for args in (
        ("show", *db, big),
        ("abandon", *db, big, "--reason", "r"),
        ("retry", *db, big),
        ("list", *db, "--after-id", big),
        ("purge", *db, "--delivered-older-than", "99999999999d"),
        ("purge", *db, "--dead-older-than", "0s", "--row", big, "--reason", "r"),
        ("retry", *db, "--all-dead", "--actor", "a" * 256),
    ):
        result = CliRunner().invoke(main, list(args))  # a traceback: exit 1 with the exception
        assert "Traceback" not in result.output and result.exit_code == 2, (args, result.output)
    assert "36500d" in _run("purge", *db, "--delivered-older-than", "99999999999d").stderr
    missing = tmp_path / "no-such-dir" / "shop.db"
    result = _run("status", "--database-url", f"sqlite:///{missing}")
    assert result.exit_code == 2 and "directory that does not exist" in result.stderr, result.output
    assert "down or busy" not in result.stderr
