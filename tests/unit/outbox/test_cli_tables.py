"""Every listing of ``orbit-outbox`` piped (``list``, ``status`` with its blocked keys, ``show``,
``reconcile``): tab-separated lines under one header line, whole values, one row a line, blocks apart by
a blank line; on a terminal, rich tables as before. CliRunner's stdout is not a terminal: it sees the piped
form. On SQLite, no Orbit server (reconcile's lookups go to a closed port)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from rich.console import Console

from outbox_adapter import Outbox, OutboxTables, enqueue
from outbox_adapter.cli import main
from tests.outbox_support import closed_port

#: A last error longer than a terminal's cut (60), with a tab, a line break and what rich would read as markup.
ERROR = "400 [bold]validation_error[/]: queue 'defualt'\tdoes not exist;\r\ncreate it: orbit-server queue create shop defualt"


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[list[str], dict[str, int]]:
    """The database options, and rows: a DEAD head of key ``c[1]`` with one PENDING row behind it, a row
    retried by an operator (one event), and a NEEDS_RECONCILE row."""
    url = f"sqlite:///{tmp_path}/shop.db"
    engine = sa.create_engine(url)
    tables = OutboxTables()
    outbox = Outbox(engine, tables=tables)
    outbox.migrate()
    with engine.begin() as conn:
        rows = {
            name: enqueue(conn, namespace="shop", queue="default", handler=f"orders.{name}", params={"n": 1},
                          ordering_key=key).id
            for name, key in (("dead", "c[1]"), ("behind", "c[1]"), ("retried", None), ("unknown", None))
        }  # fmt: skip
        row = tables.outbox.c
        dead = tables.outbox.update().where(row.id.in_([rows["dead"], rows["retried"]]))
        conn.execute(dead.values(state="DEAD", last_error=ERROR))
        conn.execute(tables.outbox.update().where(row.id == rows["unknown"]).values(state="NEEDS_RECONCILE"))
    outbox.retry(rows["retried"], actor="ops:alice", reason="queue created")
    outbox.close()
    engine.dispose()
    return ["--database-url", url], rows


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _blocks(stdout: str) -> list[list[str]]:
    """The output's blocks (apart by blank lines), each a list of lines."""
    return [block.split("\n") for block in stdout.strip("\n").split("\n\n")]


def _table(lines: list[str]) -> list[dict[str, str]]:
    """A header line and tab-separated rows as dicts; every row has exactly the header's columns."""
    header, *rows = (line.split("\t") for line in lines)
    assert all(len(row) == len(header) for row in rows), lines
    return [dict(zip(header, row, strict=True)) for row in rows]


WHOLE_ERROR = ERROR.replace("\t", " ").replace("\r\n", "  ")


def test_list_piped(seeded: tuple[list[str], dict[str, int]]) -> None:
    db, rows = seeded
    listed = _run("list", *db)
    assert listed.exit_code == 0, listed.output
    [block] = _blocks(listed.stdout)
    assert block[0].split("\t")[:3] == ["id", "state", "key"]
    by_id = {int(r["id"]): r for r in _table(block)}
    assert set(by_id) == set(rows.values())
    assert by_id[rows["dead"]]["last error"] == WHOLE_ERROR  # whole, on one line, never markup


def test_status_piped_with_its_blocked_keys(seeded: tuple[list[str], dict[str, int]]) -> None:
    db, rows = seeded
    status = _run("status", *db)
    assert status.exit_code == 0, status.output
    counts, times, blocked, ways_out = _blocks(status.stdout)
    assert counts[0] == "state\trows"
    assert {r["state"]: r["rows"] for r in _table(counts)} == {
        "PENDING": "2", "DELIVERED": "0", "DEAD": "1", "NEEDS_RECONCILE": "1", "ABANDONED": "0", "(leased now)": "0",
    }  # fmt: skip
    assert times[0].startswith("oldest pending: ") and times[1].startswith("next due: ")
    assert blocked[0] == "ordering key\tblocked by row\tstate\twaiting\tlast error"
    assert _table(blocked) == [
        {"ordering key": "c[1]", "blocked by row": str(rows["dead"]), "state": "DEAD", "waiting": "1",
         "last error": WHOLE_ERROR},
    ]  # fmt: skip
    assert ways_out == [
        f"row {rows['dead']}: fix the cause and `orbit-outbox retry {rows['dead']}`, or give it up: "
        f"`orbit-outbox abandon {rows['dead']} --reason TEXT` (releases 'c[1]')"
    ]
    # --json is as it was: the summary with the blocked keys.
    as_json = json.loads(_run("status", *db, "--json").stdout)
    assert as_json["counts"]["DEAD"] == 1 and as_json["blocked_keys"][0]["ordering_key"] == "c[1]"


def test_show_piped(seeded: tuple[list[str], dict[str, int]]) -> None:
    db, rows = seeded
    shown = _run("show", *db, str(rows["retried"]), "--params")
    assert shown.exit_code == 0, shown.output
    details, events = _blocks(shown.stdout)
    assert details[0] == "field\tvalue"
    fields = {r["field"]: r["value"] for r in _table(details)}
    assert fields["id"] == str(rows["retried"]) and fields["state"] == "PENDING"
    assert fields["params"] == '{"n": 1}' and fields["last_error"] == WHOLE_ERROR  # retry keeps it
    assert events[0] == "at (UTC)\tfrom\tto\tactor\ttask\treason"
    [event] = _table(events)
    assert (event["from"], event["to"], event["actor"]) == ("DEAD", "PENDING", "ops:alice")
    assert "queue created" in event["reason"]


def test_reconcile_piped_prints_rows_and_says_the_summary_on_stderr(
    seeded: tuple[list[str], dict[str, int]],
) -> None:
    db, rows = seeded
    env = {"ORBIT_URL": f"http://127.0.0.1:{closed_port()}", "ORBIT_API_KEY": "k"}
    failed = CliRunner().invoke(main, ["reconcile", *db, "--dry-run", "--timeout", "2"], env=env)
    assert failed.exit_code == 4, failed.output
    [block] = _blocks(failed.stdout)
    [decision] = _table(block)
    assert (decision["id"], decision["decision"], decision["applied"]) == (
        str(rows["unknown"]),
        "error",
        "no",
    )
    assert decision["detail"].startswith("lookup failed")
    assert "1 row(s) looked up (dry run, nothing changed): 0 would be decided" in failed.stderr


def test_on_a_terminal_the_listings_are_rich_tables(
    seeded: tuple[list[str], dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox_adapter.cli import _common

    monkeypatch.setattr(_common, "_piped", lambda: False)
    # The module's consoles read COLUMNS once, when first imported (maybe by another test, under xdist).
    monkeypatch.setattr(_common, "out", Console(soft_wrap=True, width=250))
    db, _rows = seeded
    listed = CliRunner().invoke(main, ["list", *db], env={"COLUMNS": "250"}, catch_exceptions=False)
    lines = listed.stdout.splitlines()
    assert lines[0] == "4 rows" and "┃ id" in lines[2]
    assert "[bold]validation_error[/]" in listed.stdout  # text, not markup
    assert "…" in listed.stdout and "queue create shop" not in listed.stdout  # cut to 60 characters
    status = CliRunner().invoke(main, ["status", *db], env={"COLUMNS": "250"}, catch_exceptions=False)
    assert "outbox orbit_outbox" in status.stdout and "blocked ordering keys" in status.stdout
    assert "\t" not in status.stdout and "\n\n" not in status.stdout
