"""``orbit-server flow ...`` as users run it (click's runner), on SQLite and MariaDB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orbit_server.cli import main
from tests.conftest import DatabaseFactory
from tests.docs_pages import page

GRAPH: dict[str, Any] = {
    "start": "approval",
    "nodes": {
        "approval": {"type": "signal", "signal": "approve", "timeout_seconds": 3600, "next": "ship",
                     "on_timeout": "expired"},
        "ship": {"type": "task", "queue": "fulfilment", "handler": "orders.ship",
                 "params": {"order_id": "$.input.order_id"}, "next": "done"},
        "done": {"type": "end"},
        "expired": {"type": "end", "status": "CANCELLED"},
    },
}  # fmt: skip


def _run(*args: str, input: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), input=input)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_flow_commands(make_database: DatabaseFactory, kind: str, tmp_path: Path) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    db = ("--database-url", url)
    ns = ("--namespace", "shop")
    assert _run("migrate", *db)[0] == 0
    assert _run("namespace", "create", "shop", *db)[0] == 0
    assert _run("queue", "create", "shop", "fulfilment", *db)[0] == 0
    graph_file = tmp_path / "approval.json"
    graph_file.write_text(json.dumps(GRAPH), encoding="utf-8")

    # Publish: a new version, then the same graph again (from stdin), then a graph with a mistake.
    code, out, err = _run("flow", "publish", str(graph_file), "--flow", "approval", *ns, *db)
    assert (code, out.strip()) == (0, "1") and "published as version 1" in err
    code, out, err = _run(
        "flow", "publish", "-", "--flow", "approval", *ns, "--json", *db, input=json.dumps(GRAPH)
    )
    assert code == 0 and json.loads(out)["version"] == 1 and "unchanged" in err
    broken = {**GRAPH, "nodes": {**GRAPH["nodes"], "ship": {**GRAPH["nodes"]["ship"], "next": "nowhere"}}}
    code, _, err = _run("flow", "publish", "-", "--flow", "approval", *ns, *db, input=json.dumps(broken))
    assert code == 2 and "graph: node 'ship': next 'nowhere' is not a node of the graph" in err
    code, _, err = _run("flow", "publish", "-", "--flow", "approval", *ns, *db, input="{not json")
    assert code == 2 and "not JSON" in err
    # A graph naming a queue the namespace lacks is published (queues may come later), with a warning.
    lacking = {"start": "a", "nodes": {"a": {"type": "task", "queue": "later", "handler": "h", "next": "b"},
                                       "b": {"type": "poll", "queue": "later", "handler": "p", "interval_seconds": 1,
                                             "max_rounds": 2, "done_path": "$.result.ok", "next": "e"},
                                       "e": {"type": "end"}}}  # fmt: skip
    code, out, err = _run("flow", "publish", "-", "--flow", "lacking", *ns, *db, input=json.dumps(lacking))
    assert (code, out.strip()) == (0, "1")
    assert "warning: queue 'later' (nodes 'a', 'b') does not exist in namespace 'shop'" in err
    assert "orbit-server queue create shop later" in err
    code, _, err = _run("flow", "publish", str(graph_file), "--flow", "approval", *ns, *db)
    assert code == 0 and "warning" not in err  # its queue "fulfilment" exists

    # A flow name the API could not address (its path takes the queue-name pattern) is bad usage.
    for bad_name in ("", "a/b c", "x" * 65):
        code, _, err = _run("flow", "publish", str(graph_file), "--flow", bad_name, *ns, *db)
        assert code == 2 and "is not a flow name" in err
    code, _, err = _run("flow", "start", "a/b", *ns, "--key", "k", *db)
    assert code == 2 and "is not a flow name" in err

    code, out, _ = _run("flow", "list", *ns, "--json", *db)
    assert code == 0 and [(f["name"], f["latest_version"]) for f in json.loads(out)] == [
        ("approval", 1),
        ("lacking", 1),
    ]
    code, out, _ = _run("flow", "list", *ns, *db)
    assert out.splitlines()[0].startswith("flow\tnewest version") and "approval\t1" in out
    code, out, _ = _run("flow", "versions", "approval", *ns, *db)
    assert code == 0 and "orbit-server cli" in out and "\t4\t" in out  # 4 nodes, published by the CLI
    code, _, err = _run("flow", "versions", "nope", *ns, *db)
    assert code == 1 and "nope" in err

    # Start once per key; the same key prints the same id; another input under it is refused.
    start = ("flow", "start", "approval", *ns, "--key", "order-1001")
    code, out, err = _run(*start, "--input", '{"order_id": 1001}', *db)
    assert code == 0 and "started" in err
    instance_id = out.strip()
    input_file = tmp_path / "input.json"
    input_file.write_text('{"order_id": 1001}', encoding="utf-8")
    code, out, err = _run(*start, "--input", f"@{input_file}", *db)
    assert (code, out.strip()) == (0, instance_id) and "already started" in err
    code, _, err = _run(*start, "--input", '{"order_id": 1002}', *db)
    assert code == 1 and "another" in err
    code, _, err = _run("flow", "start", "approval", *ns, "--key", " x", *db)
    assert code == 2 and "--key" in err
    code, _, err = _run("flow", "start", "approval", *ns, "--key", "k2", "--version", "7", *db)
    assert code == 1 and "no version 7" in err

    code, out, _ = _run("flow", "show", instance_id, "--json", *db)
    shown = json.loads(out)
    assert (
        code == 0 and shown["status"] == "RUNNING" and shown["tokens"][0]["waiting_for"] == "signal:approve"
    )
    code, out, _ = _run("flow", "instances", *ns, "--flow", "approval", "--status", "running", *db)
    assert code == 0 and instance_id in out and "approval (signal:approve)" in out

    # A signal no node waits for (a typo) is recorded, buffered for ever: the command warns.
    code, _, err = _run("flow", "signal", instance_id, "aprove", "--key", "typo", *db)
    assert code == 0 and "buffered" in err
    assert (
        "warning: no signal node of flow 'approval' version 1 waits for 'aprove'" in err
        and "'approve'" in err
    )

    # The signal moves the token on to the task step in the same transaction.
    signal = ("flow", "signal", instance_id, "approve", "--key", "order-1001:approve")
    code, out, err = _run(*signal, "--payload", '{"by": "ops"}', "--json", *db)
    assert code == 0 and json.loads(out)["consumed_by_token"] and "warning" not in err
    code, out, err = _run(*signal, "--payload", '{"by": "ops"}', *db)
    assert code == 0 and "already recorded" in err
    code, _, err = _run(*signal, "--payload", '{"by": "someone else"}', *db)
    assert code == 1 and "another name or payload" in err
    code, out, _ = _run("flow", "show", instance_id, *db)
    step = json.loads(_run("flow", "show", instance_id, "--json", *db)[1])["steps"][0]
    assert code == 0 and out.startswith(f"id:\t{instance_id}\n") and '"order_id": 1001' in out
    lines = out.splitlines()
    tokens_at, steps_at = (
        lines.index("token id\tnode\tstate\tactivation\twaiting for\tfires at (UTC)\tparent id\ttask id"),
        lines.index(
            "node\tactivation\tround\ttask id\tstatus\tcreated (UTC)\tfinished (UTC)\tresult or error"
        ),
    )
    assert tokens_at < steps_at
    token_row = lines[tokens_at + 1].split("\t")
    assert (
        token_row[1:3] == ["ship", "WAITING"] and token_row[4] == "task" and token_row[-1] == step["task_id"]
    )
    assert lines[steps_at + 1].split("\t")[:5] == [
        "ship",
        str(step["activation"]),
        "",
        step["task_id"],
        "WAITING",
    ]

    # Control, audited with the actor; a finished instance refuses (exit 1).
    control = ("--actor", "ops@example.com", "--json", *db)
    paused = json.loads(_run("flow", "pause", instance_id, "--reason", "stock audit", *control)[1])
    assert paused["status"] == "PAUSED" and paused["paused"] is True
    again = json.loads(_run("flow", "pause", instance_id, *control)[1])
    assert again["control_version"] == paused["control_version"]
    assert json.loads(_run("flow", "resume", instance_id, *control)[1])["status"] == "RUNNING"
    assert json.loads(_run("flow", "cancel", instance_id, "--reason", "customer left", *control)[1])["status"] == (
        "CANCELLED"
    )  # fmt: skip
    code, _, err = _run("flow", "cancel", instance_id, *db)
    assert code == 1 and "CANCELLED" in err
    code, _, err = _run("flow", "signal", instance_id, "approve", "--key", "late", *db)
    assert code == 1

    code, out, _ = _run("flow", "history", instance_id, "--json", *db)
    entries = json.loads(out)["items"]
    events = [e["event"] for e in entries]
    assert code == 0 and events[0] == "instance_started" and "instance_paused" in events
    paused_entry = next(e for e in entries if e["event"] == "instance_paused")
    assert paused_entry["actor"] == "ops@example.com (orbit-server cli)"
    code, out, err = _run("flow", "history", instance_id, "--limit", "2", *db)
    assert code == 0 and len(out.splitlines()) == 3 and "raise --limit" in err  # header + 2 rows
    code, out, _ = _run("flow", "instances", *ns, "--status", "CANCELLED", "--json", *db)
    assert [i["id"] for i in json.loads(out)["items"]] == [instance_id]

    for command in (("show", "0b6f6f0e-4a4f-4d55-8f3e-3d8b2b7f2a10"), ("history", "nope"), ("pause", "nope")):
        code, _, err = _run("flow", *command, *db)
        assert code == 1 and "no flow instance" in err
    code, _, err = _run("flow", "list", "--namespace", "nowhere", *db)
    assert code == 1

    # An instance that fails at once (its input lacks a path) says why on stderr, not only FAILED.
    needs = {"start": "a", "nodes": {"a": {"type": "task", "queue": "fulfilment", "handler": "h",
                                           "params": {"x": "$.input.x"}, "next": "e"}, "e": {"type": "end"}}}  # fmt: skip
    assert _run("flow", "publish", "-", "--flow", "needs", *ns, *db, input=json.dumps(needs))[0] == 0
    code, _, err = _run("flow", "start", "needs", *ns, "--key", "n-1", *db)
    assert (
        code == 0
        and "instance started, FAILED (flow_path_missing: node 'a': path $.input.x is missing" in err
    )


def test_flow_commands_as_a_real_process(make_database: DatabaseFactory, tmp_path: Path) -> None:
    """The installed entry point, with the database and namespace from the environment (as in --help)."""
    url = make_database("sqlite").render_as_string(hide_password=False)
    env = {**os.environ, "ORBIT_DATABASE_URL": url, "ORBIT_NAMESPACE": "shop"}

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "orbit_server", *args], env=env, input=stdin,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    assert run("migrate").returncode == 0
    assert run("namespace", "create", "shop").returncode == 0
    assert run("queue", "create", "shop", "fulfilment").returncode == 0
    published = run("flow", "publish", "-", "--flow", "approval", stdin=json.dumps(GRAPH))
    assert (published.returncode, published.stdout.strip()) == (0, "1"), published.stderr
    started = run("flow", "start", "approval", "--key", "k-1", "--input", '{"order_id": 1}')
    assert started.returncode == 0, started.stderr
    shown = run("flow", "show", started.stdout.strip(), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["flow"] == "approval"
    gone = run("flow", "list", "--database-url", "mysql+pymysql://root@127.0.0.1:1/none")
    assert gone.returncode == 3 and "cannot use the database" in gone.stderr


def test_the_documented_flow_commands_run(make_database: DatabaseFactory, tmp_path: Path) -> None:
    """The shell block of the docs' "The orbit-server flow commands" (how-to/flows.md), as written, from the
    repository root."""
    repo = Path(__file__).resolve().parents[2]
    howto = page("how-to/flows.md")
    section = howto[howto.index("## The `orbit-server flow` commands") :]
    block = section[section.index("```sh\n") + 6 : section.index("```\n", section.index("```sh\n") + 6)]
    url = make_database("sqlite").render_as_string(hide_password=False)
    # The block keeps the reader's ORBIT_DATABASE_URL, exported in the first hour's tutorial (issue 23).
    assert "export ORBIT_DATABASE_URL" not in block
    script = f"export ORBIT_DATABASE_URL={url}\n{block}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    setup = f"orbit-server migrate --database-url {url} && orbit-server namespace create shop --database-url {url} && " \
            f"orbit-server queue create shop fulfilment --database-url {url}"  # fmt: skip
    assert subprocess.run(["bash", "-c", setup], env=env, capture_output=True, timeout=60).returncode == 0
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    history = json.loads(done.stdout[done.stdout.index('{\n  "items"') :])["items"]
    # Paused, the signal was buffered; the resume let it move the token on to the ship task.
    [paused] = [entry for entry in history if entry["event"] == "instance_paused"]
    assert paused["actor"].startswith("ops@example.com")
    events = [entry["event"] for entry in history]
    assert events.index("instance_paused") < events.index("instance_resumed")
    assert "ship\tWAITING" in done.stdout


def test_the_example_graph_file_is_the_python_examples_graph() -> None:
    repo = Path(__file__).resolve().parents[2]
    source = (repo / "examples" / "flow_client_example.py").read_text(encoding="utf-8")
    scope: dict[str, Any] = {}
    exec(source.split("\nwith OrbitClient")[0], scope)  # the imports and GRAPH, nothing sent
    assert (
        json.loads((repo / "examples" / "order_approval.json").read_text(encoding="utf-8")) == scope["GRAPH"]
    )
