"""``orbit-server schedule ...`` as users run it (click's runner), on SQLite and MariaDB."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orbit_server.cli import main
from orbit_server.db.engine import create_engine
from orbit_server.db.schema import schedule_events
from orbit_server.db.schema import schedules as schedules_table
from orbit_server.schedules import schedules
from tests.conftest import DatabaseFactory


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_schedule_commands(make_database: DatabaseFactory, kind: str) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    db = ("--database-url", url)
    assert _run("migrate", *db)[0] == 0
    assert _run("namespace", "create", "acme", *db)[0] == 0
    assert _run("queue", "create", "acme", "reports", *db)[0] == 0

    code, out, _ = _run("schedule", "create", "acme", "nightly", "--queue", "reports", "--handler", "reports.run",
                        "--params", '{"kind": "daily"}', "--cron", "30 2 * * *", "--timezone", "Europe/Berlin",
                        "--misfire-policy", "run_once", "--json", *db)  # fmt: skip
    assert code == 0, out
    created = json.loads(out)
    assert (created["cron"], created["timezone"], created["params"], created["version"]) == (
        "30 2 * * *", "Europe/Berlin", {"kind": "daily"}, 1
    )  # fmt: skip
    code, out, _ = _run("schedule", "create", "acme", "ticks", "--queue", "reports", "--handler", "t",
                        "--interval", "60", *db)  # fmt: skip
    assert code == 0 and "every 60 s (UTC)" in out

    code, out, _ = _run("schedule", "list", "acme", "--json", *db)
    assert code == 0 and [s["name"] for s in json.loads(out)] == ["nightly", "ticks"]
    code, out, _ = _run("schedule", "show", "acme", "nightly", *db)
    assert code == 0 and "cron '30 2 * * *' in Europe/Berlin" in out and "active" in out
    assert json.loads(_run("schedule", "pause", "acme", "nightly", "--json", *db)[1])["paused"] is True
    assert "paused" in _run("schedule", "show", "acme", "nightly", *db)[1]

    # Fire it once (move its next fire to the past, resume, run one scheduler pass).
    engine = create_engine(url)
    with engine.begin() as conn:
        row = (
            conn.execute(sa.select(schedules_table).where(schedules_table.c.name == "nightly"))
            .mappings()
            .one()
        )
        conn.execute(schedules_table.update().where(schedules_table.c.id == row["id"])
                     .values(next_fire_at=row["next_fire_at"] - timedelta(days=3),
                             start_at=row["start_at"] - timedelta(days=3)))  # fmt: skip
    assert json.loads(_run("schedule", "resume", "acme", "nightly", "--json", *db)[1])["paused"] is False
    assert schedules.fire_due(engine, default_max_attempts=3, key_ttl=timedelta(days=7)) == 1
    code, out, _ = _run("schedule", "occurrences", "acme", "nightly", "--json", *db)
    [occurrence] = json.loads(out)
    assert (
        code == 0 and occurrence["status"] == "created" and occurrence["task_id"] and occurrence["misfired"]
    )
    code, out, _ = _run("schedule", "occurrences", "acme", "nightly", *db)
    assert occurrence["task_id"] in out

    # Refusals: exit 1 with the reason, or 2 for bad usage.
    code, _, err = _run("schedule", "create", "acme", "x", "--queue", "reports", "--handler", "h",
                        "--cron", "61 * * * *", *db)  # fmt: skip
    assert code == 1 and "invalid cron expression" in err
    code, _, err = _run("schedule", "create", "acme", "x", "--queue", "reports", "--handler", "h",
                        "--cron", "* * * * *", "--timezone", "Nowhere/Else", *db)  # fmt: skip
    assert code == 1 and "unknown time zone" in err
    code, _, err = _run("schedule", "create", "acme", "x", "--queue", "reports", "--handler", "h", *db)
    assert code == 2 and "exactly one of cron and interval_seconds" in err
    code, _, err = _run("schedule", "create", "acme", "nightly", "--queue", "reports", "--handler", "h",
                        "--interval", "5", *db)  # fmt: skip
    assert code == 1 and "already exists" in err
    code, _, err = _run(
        "schedule", "create", "acme", "x", "--queue", "nope", "--handler", "h", "--interval", "5", *db
    )
    assert code == 1 and "queue 'nope' does not exist" in err

    assert _run("schedule", "delete", "acme", "nightly", *db)[0] == 0
    code, _, err = _run("schedule", "show", "acme", "nightly", *db)
    assert code == 1 and "does not exist" in err
    with engine.begin() as conn:
        events = conn.execute(
            sa.select(schedule_events.c.event, schedule_events.c.actor)
            .where(schedule_events.c.schedule_id == row["id"])
            .order_by(schedule_events.c.id)
        ).all()
    engine.dispose()
    assert [e.event for e in events] == ["created", "paused", "resumed", "deleted"]
    assert {e.actor for e in events} == {"orbit-server cli"}
