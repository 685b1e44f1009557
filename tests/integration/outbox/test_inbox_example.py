"""The README's inbox example runs as written, after the outbox example, on each business database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from click.testing import CliRunner

from orbit_client import OrbitClient
from orbit_server.cli import main as server_main
from outbox_adapter import OutboxTables
from tests.conftest import DatabaseFactory
from tests.docs_pages import nav_pages, page
from tests.integration.outbox.conftest import Biz
from tests.servers import run_server

REPO = Path(__file__).resolve().parents[3]
#: The first-hour tutorial, whose setup blocks come before the outbox tutorial's example.
FIRST_HOUR = page("tutorials/first-hour.md")
DOCS_SETUP = [
    line for block in FIRST_HOUR.split("```sh\n")[1:] for line in block.split("```", 1)[0].splitlines()
]


def _run(example: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_inbox_example_applies_the_result_once(
    biz: Biz, make_database: DatabaseFactory, tmp_path: Path
) -> None:
    with biz.engine.begin() as conn:  # the examples use the default table names
        for name in (
            "orders",
            "orbit_inbox",
            "orbit_outbox_events",
            "orbit_outbox",
            "orbit_outbox_alembic_version",
        ):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
    with run_server(make_database("sqlite")) as orbit:
        keys = orbit.add_namespace("shop", ("fulfilment",))
        env = {
            **os.environ,
            "ORBIT_URL": orbit.base_url,
            "ORBIT_OUTBOX_DATABASE_URL": biz.url.render_as_string(False),
        }
        # The docs' order (regression, issue 10: the subscription came after the task had finished): the
        # first hour's setup creates the subscription, and the outbox tutorial, which runs the outbox
        # example, comes after it in the site's navigation.
        [command] = [line.split("#")[0].split() for line in DOCS_SETUP if "subscription create" in line]
        assert command[:2] == ["orbit-server", "subscription"]
        assert " ".join(command) in FIRST_HOUR
        assert "# examples/outbox_example.py" in page("tutorials/outbox-and-inbox.md")
        assert nav_pages().index("tutorials/first-hour.md") < nav_pages().index(
            "tutorials/outbox-and-inbox.md"
        )
        url = orbit.database_url.render_as_string(hide_password=False)
        created = CliRunner().invoke(server_main, [*command[1:], "--database-url", url])
        assert created.exit_code == 0, created.output
        with OrbitClient(orbit.base_url, api_key=keys["admin"]) as admin:
            _run(
                "outbox_example.py", {**env, "ORBIT_API_KEY": keys["submit"]}, tmp_path
            )  # order 1 and its task
            [grant] = admin.lease_tasks(
                "shop", "fulfilment", worker_id="example-worker"
            )  # a worker does the job
            admin.start_attempt("shop", grant.attempt.id, grant.attempt.lease_token)
            admin.complete_attempt("shop", grant.attempt.id, grant.attempt.lease_token, {"receipt": "r-1"})
        first = _run("inbox_example.py", {**env, "ORBIT_API_KEY": keys["work"]}, tmp_path)
        second = _run("inbox_example.py", {**env, "ORBIT_API_KEY": keys["work"]}, tmp_path)
    assert first == "1 0 1 COMPLETED"  # applied, duplicates, acked, order statuses
    assert second == "0 0 0 COMPLETED"  # acked: never delivered again
    outbox = OutboxTables().outbox
    with biz.engine.connect() as conn:
        follow_ups = conn.execute(sa.select(outbox.c.handler, outbox.c.params).order_by(outbox.c.id)).all()
    assert [h for h, _ in follow_ups] == ["orders.fulfil", "orders.send_receipt"]
    assert follow_ups[1][1] == {"task_id": grant.task.id}
