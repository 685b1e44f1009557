"""``orbit-server`` admin commands as an operator runs them (click's runner), against the database of a
real server on SQLite and MariaDB: find a failed task by its idempotency key, read its traceback,
retry it, review a NEEDS_REVIEW task, cancel, revoke a key, see subscriptions, namespaces and queues."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from orbit_client import OrbitClient, TaskContext, Worker
from orbit_server.cli import main
from orbit_server.tasks import store
from tests.conftest import DatabaseFactory
from tests.console_support import TRACEBACK, Seeder
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database(request.param), api_key_cache_seconds=0) as running:
        running.keys = running.add_namespace("shop")
        yield running


@pytest.fixture(scope="module")
def seed(server: RunningServer) -> Iterator[Seeder]:
    seeder = Seeder(server, "shop", server.keys)
    yield seeder
    seeder.close()


def cli(server: RunningServer, *args: str, code: int = 0) -> str:
    url = server.database_url.render_as_string(hide_password=False)
    result = CliRunner(env={"USER": "alice"}).invoke(main, [*args, "--database-url", url])
    assert result.exit_code == code, (result.output, result.stderr)
    return result.stdout if code == 0 else result.stderr


def cli_json(server: RunningServer, *args: str) -> Any:
    return json.loads(cli(server, *args, "--json"))


def test_find_a_failed_task_by_key_read_its_traceback_and_retry_it(
    server: RunningServer, seed: Seeder
) -> None:
    failed = seed.failed("order-cli-1")
    listed = cli_json(server, "task", "list", "--idempotency-key", "order-cli-1")
    assert [t["id"] for t in listed["items"]] == [failed] and listed["items"][0]["status"] == "FAILED"
    plain = cli(server, "task", "list", "--status", "failed", "--since", "1h")
    header, *rows = plain.splitlines()
    assert header.split("\t")[:6] == ["id", "namespace", "queue", "handler", "status", "priority"]
    assert any(row.split("\t")[0] == failed for row in rows)  # whole ids, one row a line
    shown = cli(server, "task", "show", failed)
    assert "KeyError: 'order_id'" in shown and TRACEBACK.strip() in shown and "order-cli-1" in shown
    assert "worker-7" in shown and "RUNNING" in shown and "\npriority:\t0\n" in shown
    by_lease = cli_json(server, "task", "list", "--order", "lease", "--idempotency-key", "order-cli-1")
    assert [t["id"] for t in by_lease["items"]] == [failed]
    detail = cli_json(server, "task", "show", failed)
    assert detail["task"]["error"]["traceback"] == TRACEBACK and detail["idempotency_key"] == "order-cli-1"
    assert [e["event"] for e in detail["events"]] == ["accepted", "leased", "started", "failed"]

    out = cli(server, "task", "retry", failed, "--reason", "handler fixed")
    successor = out.strip().splitlines()[-1]
    assert seed.task(successor)["retry_of"] == failed
    event = seed.events(failed)[-1]
    assert (event["event"], event["actor"], event["reason"]) == ("retried", "cli:alice", "handler fixed")
    again = cli(server, "task", "retry", failed, "--reason", "twice", code=1)
    assert "already retried" in again
    assert cli_json(server, "task", "show", successor)["retry_of_chain"] == [failed]


def test_a_real_workers_failure_shows_its_traceback_in_task_show(server: RunningServer, seed: Seeder) -> None:
    """Issue 10, item 3: the worker SDK sends the handler's traceback; `task show` prints it."""
    with server.engine.begin() as conn:
        store.create_queue(conn, "shop", "real-worker")

    def charge(ctx: TaskContext) -> Any:
        return ctx.params["order_id"]

    task_id = seed.submit("real-worker", "charge", {"amount": 5}, key="order-real-worker")["id"]
    with OrbitClient(server.base_url, api_key=server.keys["work"]) as client:
        worker = Worker(client, "shop", "real-worker", {"charge": charge}, poll_wait_seconds=0.2,
                        install_signal_handlers=False)  # fmt: skip
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while seed.task(task_id)["status"] != "FAILED":
                assert time.monotonic() < deadline, seed.task(task_id)
                time.sleep(0.05)
        finally:
            worker.stop()
            thread.join(30)
    shown = cli(server, "task", "show", task_id)
    assert "in charge" in shown and 'return ctx.params["order_id"]' in shown
    assert "KeyError: 'order_id'" in shown
    error = cli_json(server, "task", "show", task_id)["task"]["error"]
    assert error["type"] == "KeyError" and error["traceback"].endswith("KeyError: 'order_id'\n")


def test_review_and_cancel(server: RunningServer, seed: Seeder) -> None:
    task_id = seed.needs_review()
    assert task_id in cli(server, "task", "list", "--status", "NEEDS_REVIEW")
    cli(
        server, "task", "review", task_id, "--outcome", "failed", "--reason", "never charged", code=2
    )  # no evidence
    cli(
        server,
        "task",
        "review",
        task_id,
        "--outcome",
        "failed",
        "--reason",
        "never charged",
        "--evidence-ref",
        "PSP-9",
    )
    assert seed.task(task_id)["status"] == "FAILED"
    event = seed.events(task_id)[-1]
    assert event["actor"] == "cli:alice" and event["data"]["evidence_ref"] == "PSP-9"
    assert "only a NEEDS_REVIEW task" in cli(
        server,
        "task",
        "review",
        task_id,
        "--outcome",
        "failed",
        "--reason",
        "r",
        "--evidence-ref",
        "e",
        code=1,
    )
    waiting = seed.submit()
    assert (
        cli_json(server, "task", "cancel", waiting["id"], "--reason", "not wanted")["status"] == "CANCELLED"
    )
    assert "no task" in cli(server, "task", "cancel", "no-such-task", "--reason", "x", code=1)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--result", '{"ok": NaN}', "NaN and infinite numbers are not JSON"),
        ("--result", "1e400", "NaN and infinite numbers are not JSON"),
        ("--result", '"\\ud800"', "a lone surrogate"),
        ("--result", "[" * 40 + "]" * 40, "nested deeper than 30 levels"),
        ("--reason", "r" * 2001, "give 1 to 2000 characters"),
    ],
)
def test_review_refuses_what_the_api_refuses(
    server: RunningServer, seed: Seeder, option: str, value: str, message: str
) -> None:
    # Found by a new user's walkthrough: a review with a lone surrogate in its result was recorded, and
    # every task listing of the namespace then answered 500.
    task_id = seed.needs_review()
    args = {"--reason": "charged", "--result": '{"ok": true}', option: value}
    out = cli(
        server, "task", "review", task_id, "--outcome", "succeeded", "--evidence-ref", "PSP-1",
        *(part for pair in args.items() for part in pair), code=2,
    )  # fmt: skip
    assert message in out and option in out and TRACEBACK not in out
    assert seed.task(task_id)["status"] == "NEEDS_REVIEW"


def test_revoked_key_gets_401(server: RunningServer) -> None:
    with server.engine.begin() as conn:
        key = store.create_api_key(conn, "shop", "read", "to be revoked")
    keys = cli_json(server, "api-key", "list", "--namespace", "shop")
    read = next(k for k in keys if k["label"] == "to be revoked")
    assert key.startswith(read["prefix"]) and read["revoked_at"] is None
    url = f"{server.base_url}/v1/namespaces/shop/tasks"
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(url, headers=headers).status_code == 200
    cli(server, "api-key", "revoke", str(read["id"]), "--reason", "rotated")
    assert httpx.get(url, headers=headers).status_code == 401  # ORBIT_API_KEY_CACHE_SECONDS=0 here
    after = next(k for k in cli_json(server, "api-key", "list") if k["id"] == read["id"])
    assert after["revoked_at"] is not None
    assert "no API key" in cli(server, "api-key", "revoke", "999999", code=1)


def test_subscriptions_namespaces_and_queues(server: RunningServer, seed: Seeder) -> None:
    cli(server, "subscription", "create", "shop", "audit")
    assert cli_json(server, "subscription", "show", "shop", "audit")["undelivered"] == 0
    seed.failed("order-cli-sub", with_traceback=False)  # its FAILED result event goes to `audit`
    shown = cli_json(server, "subscription", "show", "shop", "audit")
    assert shown["undelivered"] == 1 and shown["unacked"] == 0 and shown["oldest_pending_seconds"] is not None
    listed = cli(server, "subscription", "list")
    assert any(line.startswith("shop\taudit\t*\t1\t0\t") for line in listed.splitlines())
    assert "no subscription" in cli(server, "subscription", "show", "shop", "nope", code=1)

    namespaces = cli_json(server, "namespace", "list")
    assert [n["name"] for n in namespaces] == ["shop"] and namespaces[0]["tasks"] >= 1
    queues = cli_json(server, "queue", "list", "--namespace", "shop")
    assert sum(q["counts"].get("FAILED", 0) for q in queues) >= 1
    assert sum(q["failed_last_hour"] for q in queues) >= 1
    assert "namespace 'nope' does not exist" in cli(server, "queue", "list", "--namespace", "nope", code=1)


def _stderr_of(server: RunningServer, *args: str) -> str:
    url = server.database_url.render_as_string(hide_password=False)
    result = CliRunner(env={"USER": "alice"}).invoke(main, [*args, "--database-url", url])
    assert result.exit_code == 0, (result.output, result.stderr)
    return result.stderr


def test_cancel_twice_says_the_second_changed_nothing(server: RunningServer, seed: Seeder) -> None:
    """Issue 23: a second `task cancel` printed "cancel recorded" again."""
    waiting = seed.submit(seed.queue())
    first = _stderr_of(server, "task", "cancel", waiting["id"], "--reason", "not wanted")
    assert first.startswith("cancel recorded")
    again = _stderr_of(server, "task", "cancel", waiting["id"], "--reason", "not wanted")
    assert "already cancelled" in again and "cancel recorded" not in again
    events = [e["event"] for e in seed.events(waiting["id"])]
    assert events.count("cancelled") == 1


def test_queue_list_shows_whether_each_queue_is_paused(server: RunningServer, seed: Seeder) -> None:
    """Issue 23: `queue list` had no paused column."""
    queue = seed.queue()
    cli(server, "queue", "pause", "shop", queue, "--reason", "maintenance")
    header, *rows = cli(server, "queue", "list", "--namespace", "shop").splitlines()
    columns = header.split("\t")
    assert "paused" in columns
    row = next(dict(zip(columns, r.split("\t"), strict=True)) for r in rows if r.split("\t")[1] == queue)
    assert row["paused"] == "yes"
    assert any(dict(zip(columns, r.split("\t"), strict=True))["paused"] == "no" for r in rows)
    assert next(q for q in cli_json(server, "queue", "list", "--namespace", "shop") if q["name"] == queue)[
        "paused"
    ]


# ---------------------------------------------- issue 30: what the last bad-input pass left


def test_huge_ages_big_ids_and_long_actors_are_usage_errors_not_tracebacks(server: RunningServer) -> None:
    for args in (
        ("task", "list", "--since", "99999999999d"),
        ("task", "list", "--since", "36501d"),
        ("retention", "inventory", "--before", "99999999999d"),
        ("retention", "inventory", "--before", "0001-01-01T00:00:00+14:00"),
        ("purge", "--tasks-older-than", "99999999999d"),
        ("api-key", "revoke", str(2**63)),
        ("task", "cancel", "x", "--reason", "r", "--actor", "a" * 256),
    ):
        assert "Traceback" not in cli(server, *args, code=2), args  # a traceback was exit 1
    assert "36500d" in cli(server, "task", "list", "--since", "99999999999d", code=2)
    assert "at most 255" in cli(server, "task", "cancel", "x", "--reason", "r", "--actor", "a" * 256, code=2)
    cli(server, "task", "list", "--since", "36500d")


def test_a_second_revoke_says_it_changed_nothing(server: RunningServer) -> None:
    url = server.database_url.render_as_string(hide_password=False)
    created = CliRunner().invoke(main, ["api-key", "create", "shop", "--role", "read", "--database-url", url])
    key_id = json.loads(cli(server, "api-key", "list", "--namespace", "shop", "--json"))[-1]["id"]
    assert created.exit_code == 0
    first = CliRunner().invoke(main, ["api-key", "revoke", str(key_id), "--database-url", url])
    again = CliRunner().invoke(main, ["api-key", "revoke", str(key_id), "--database-url", url])
    assert first.exit_code == again.exit_code == 0
    assert "revoked at" in first.stderr and "already" not in first.stderr
    assert "already revoked" in again.stderr and "nothing changed" in again.stderr


def test_schedule_list_prints_tab_separated_rows_when_piped(server: RunningServer) -> None:
    cli(server, "schedule", "create", "shop", "nightly", "--queue", "default", "--handler", "h", "--cron",
        "0 3 * * *", "--timezone", "Europe/Berlin")  # fmt: skip
    header, *rows = cli(server, "schedule", "list", "shop").splitlines()
    assert header.split("\t")[:3] == ["name", "state", "trigger"]
    [row] = [r.split("\t") for r in rows if r.startswith("nightly\t")]
    assert row[1] == "active" and "Europe/Berlin" in row[2]
    shown = json.loads(cli(server, "schedule", "show", "shop", "nightly", "--json"))
    assert shown["params"] == {}  # no --params: {} as a submission without params gets
    message = cli(server, "schedule", "create", "shop", "both", "--queue", "default", "--handler", "h",
                  "--cron", "0 3 * * *", "--interval", "60", code=2)  # fmt: skip
    assert "Value error" not in message and "exactly one of cron and interval_seconds" in message


def test_queue_pause_of_a_missing_queue_names_the_namespace(server: RunningServer) -> None:
    message = cli(server, "queue", "pause", "shop", "nosuch", code=1)
    assert "'nosuch' does not exist in namespace 'shop'" in message, message


def test_purge_dry_run_says_it_was_one(server: RunningServer) -> None:
    url = server.database_url.render_as_string(hide_password=False)
    result = CliRunner().invoke(
        main, ["purge", "--tasks-older-than", "30d", "--dry-run", "--database-url", url]
    )
    assert result.exit_code == 0, result.output
    assert "dry run: nothing was deleted" in result.stderr
