"""``orbit-server`` as users run it: click's runner for the commands, real processes for
``serve`` and the quick-start demo."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from orbit_server.cli import main
from tests.conftest import DatabaseFactory
from tests.server_processes import START_TIMEOUT, free_port

REPO = Path(__file__).resolve().parents[2]
KINDS = [
    "sqlite",
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
NETWORKED = [
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_admin_commands(make_database: DatabaseFactory, kind: str) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    assert _run("migrate", "--database-url", url)[0] == 0
    assert _run("namespace", "create", "shop", "--database-url", url)[0] == 0
    code, _, err = _run("namespace", "create", "shop", "--database-url", url)
    assert code == 1 and "already exists" in err
    assert _run("queue", "create", "shop", "fulfilment", "--database-url", url)[0] == 0
    code, _, err = _run("queue", "create", "nowhere", "fulfilment", "--database-url", url)
    assert code == 1 and "does not exist" in err
    code, _, err = _run("queue", "create", "shop", "bad name!", "--database-url", url)
    assert code == 2 and "QUEUE" in err
    code, out, _ = _run("api-key", "create", "shop", "--role", "submit", "--database-url", url)
    assert code == 0 and out.strip().splitlines()[-1].startswith("orbit_")
    code, _, err = _run("api-key", "create", "shop", "--role", "root", "--database-url", url)
    assert code == 2 and "root" in err


@pytest.mark.parametrize("kind", KINDS)
def test_a_too_long_api_key_label_is_refused_naming_the_limit(
    make_database: DatabaseFactory, kind: str
) -> None:
    """Issue 9: a 256-character label printed a traceback on MariaDB; now the same clear error everywhere."""
    url = make_database(kind).render_as_string(hide_password=False)
    assert _run("migrate", "--database-url", url)[0] == 0
    assert _run("namespace", "create", "shop", "--database-url", url)[0] == 0
    code, out, err = _run(
        "api-key", "create", "shop", "--role", "read", "--label", "x" * 256, "--database-url", url
    )
    assert code == 2 and "Traceback" not in err and not out
    assert "256 characters; the limit is 255" in err and "--label" in err
    code, out, _ = _run(
        "api-key", "create", "shop", "--role", "read", "--label", "x" * 255, "--database-url", url
    )
    assert code == 0 and out.strip().startswith("orbit_")


def test_database_url_from_environment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    assert CliRunner(env={"ORBIT_DATABASE_URL": url}).invoke(main, ["migrate"]).exit_code == 0
    result = CliRunner(env={"ORBIT_DATABASE_URL": url}).invoke(main, ["namespace", "create", "from-env"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "env.db").exists()
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for var in ("ORBIT_DATABASE_URL", "ORBIT_HOST", "ORBIT_PORT", "ORBIT_MAX_BODY_BYTES"):
        assert var in help_text


def test_unreachable_database_is_exit_3() -> None:
    code, _, err = _run("namespace", "create", "x", "--database-url", "mysql+pymysql://root@127.0.0.1:1/none")
    assert code == 3 and "cannot use the database" in err


def test_serve_migrates_sqlite_and_stops_on_sigterm(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'orbit.db'}"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit_server", "serve", "--database-url", url, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # no start-up signal to await: poll readiness with a deadline
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.05)
        assert ready.status_code == 200
        docs = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5).json()
        assert "/v1/namespaces/{namespace}/tasks" in docs["paths"]
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "Finished server process" in output


@pytest.mark.parametrize("kind", NETWORKED)
def test_serve_refuses_an_unmigrated_database_in_one_line(make_database: DatabaseFactory, kind: str) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    result = subprocess.run(
        [sys.executable, "-m", "orbit_server", "serve", "--database-url", url, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "orbit-server migrate" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+asyncpg://u@127.0.0.1/orbit", "use postgresql+psycopg://"),
        ("postgresql+psycopg2://u@127.0.0.1/orbit", "use postgresql+psycopg://"),
        ("oracle+oracledb://u@127.0.0.1/orbit", "postgresql+psycopg://user:pw@host/orbit (PostgreSQL 15+)"),
        ("mariadb+pymysql://u@127.0.0.1/orbit", "mysql+pymysql://user:pw@host/orbit"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "migrate"])
def test_serve_and_migrate_on_a_database_the_server_does_not_run_on_say_which_url_to_use(
    command: str, url: str, says: str
) -> None:
    """Issue 32: such a URL printed a traceback (or worked half-way); now one line, exit 2, nothing done."""
    code, out, err = _run(command, "--database-url", url)
    assert code == 2 and says in err and not out, err
    assert len(err.strip().splitlines()) == 1 or "Usage:" in err, err  # click's usage line, then the error
    assert [line for line in err.splitlines() if line.startswith("Error")] == [
        line for line in err.splitlines() if "--database-url:" in line
    ], err


def test_an_unreachable_postgresql_database_is_one_line_exit_3() -> None:
    code, _, err = _run("migrate", "--database-url", "postgresql+psycopg://postgres@127.0.0.1:1/none")
    assert code == 3 and "cannot use the database" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("kind", NETWORKED)
def test_serve_waits_for_a_database_that_comes_up_within_wait_for_database(
    make_database: DatabaseFactory, kind: str
) -> None:
    """Regression (Galera chaos run): a server restarted while its cluster node was down exited 3 at
    once. With --wait-for-database it keeps trying, then serves once the database answers."""
    url = make_database(kind)
    assert _run("migrate", "--database-url", url.render_as_string(hide_password=False))[0] == 0
    db_port, port = free_port(), free_port()  # nothing listens on db_port until the proxy starts
    behind = url.set(port=db_port).render_as_string(hide_password=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit_server", "serve", "--database-url", behind, "--port", str(port),
         "--wait-for-database", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proxy: subprocess.Popen[str] | None = None
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "cannot use the database yet" in first and proc.poll() is None, first
        proxy = subprocess.Popen(
            [sys.executable, "-m", "bench.chaos.proxy", "--port", str(db_port),
             "--target-port", str(url.port or (3306 if kind == "mariadb" else 5432))],
            cwd=REPO,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # the server retries once a second: poll readiness with a deadline
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, f"serve exited {proc.returncode}"
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        assert ready.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)


def test_serve_exits_3_when_the_database_stays_unusable_past_the_wait() -> None:
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "orbit_server", "serve", "--database-url", "mysql+pymysql://root@127.0.0.1:1/none",
         "--port", str(free_port()), "--wait-for-database", "1.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 3 and "cannot use the database at" in result.stderr
    assert "trying again" in result.stderr and time.monotonic() - began >= 1.5


def test_quick_start_demo_shows_a_replay(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    result = subprocess.run(
        [sys.executable, "-m", "examples.replay_demo"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "The second answer was a replay of the first" in result.stdout


@pytest.mark.parametrize("kind", NETWORKED)
def test_admin_commands_on_an_unmigrated_database_say_to_migrate(
    make_database: DatabaseFactory, kind: str
) -> None:
    """Regression (new-user trial): this printed a traceback ending in 'Table ... doesn't exist'."""
    url = make_database(kind).render_as_string(hide_password=False)
    code, _, err = _run("namespace", "create", "shop", "--database-url", url)
    assert code == 1 and "orbit-server migrate" in err and "Traceback" not in err


def test_serve_on_a_busy_port_says_so(tmp_path: Path) -> None:
    """Regression (new-user trial): uvicorn's exit 3 read as 'database unreachable'."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        url = f"sqlite:///{tmp_path / 'orbit.db'}"
        code, _, err = _run("serve", "--database-url", url, "--port", str(port))
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(p) for p in children.read().split()]


@pytest.mark.parametrize("kind", NETWORKED)
def test_serve_with_two_worker_processes_answers_accepts_and_wakes_long_polls(
    make_database: DatabaseFactory, kind: str
) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    assert _run("migrate", "--database-url", url)[0] == 0
    assert _run("namespace", "create", "shop", "--database-url", url)[0] == 0
    assert _run("queue", "create", "shop", "q", "--database-url", url)[0] == 0
    keys = {
        role: _run("api-key", "create", "shop", "--role", role, "--database-url", url)[1]
        .strip()
        .splitlines()[-1]
        for role in ("submit", "work")
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orbit_server",
            "serve",
            "--database-url",
            url,
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # no start-up signal to await: poll readiness with a deadline
            try:
                if (
                    httpx.get(f"{base}/readyz", timeout=1).status_code == 200
                    and len(_children(proc.pid)) >= 2
                ):
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        workers = [p for p in _children(proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 2  # uvicorn's supervisor and its two worker processes

        def submit(n: int) -> int:
            with httpx.Client(base_url=base, timeout=30) as http:  # a new connection each time
                return http.post(
                    "/v1/namespaces/shop/tasks",
                    json={"queue": "q", "handler": "h", "params": {"n": n}},
                    headers={"Authorization": f"Bearer {keys['submit']}", "Idempotency-Key": f"k-{n}"},
                ).status_code

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(submit, range(40))) == [201] * 40
            assert list(pool.map(submit, range(40))) == [200] * 40  # replays, whichever process answers

        # A lease call long-polling in either process gets a task submitted through either process
        # well before its wait ends (at once in the same process, within the poll interval otherwise).
        with httpx.Client(base_url=base, timeout=30) as http:
            work = {"Authorization": f"Bearer {keys['work']}"}
            while http.post("/v1/namespaces/shop/queues/q/leases", headers=work,
                            json={"worker_id": "w", "max_tasks": 100, "lease_seconds": 60}).json():  # fmt: skip
                pass  # drain the 40 tasks
            with ThreadPoolExecutor(1) as pool:
                started = time.monotonic()
                waiting = pool.submit(
                    http.post, "/v1/namespaces/shop/queues/q/leases", headers=work,
                    json={"worker_id": "w", "max_tasks": 1, "lease_seconds": 60, "wait_seconds": 20},
                )  # fmt: skip
                assert submit(1000) == 201
                grants = waiting.result().json()
                assert len(grants) == 1 and time.monotonic() - started < 10
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), output


def test_admin_commands_never_make_a_new_sqlite_database_nor_read_a_file_that_is_none(tmp_path: Path) -> None:
    """Issue 30: a typo in ORBIT_DATABASE_URL made a new, empty database (the README says an unmigrated
    database exits 1), and a file that is no database printed a traceback."""
    typo = tmp_path / "orbt.db"
    result = CliRunner().invoke(main, ["namespace", "list", "--database-url", f"sqlite:///{typo}"])
    assert result.exit_code == 1 and f"no SQLite database at {typo}" in result.stderr, result.output
    assert "orbit-server migrate" in result.stderr and not typo.exists()
    text = tmp_path / "notes.txt"
    text.write_text("not a database, just some text that is long enough " * 40)
    for args in (["namespace", "list"], ["migrate"]):
        result = CliRunner().invoke(main, [*args, "--database-url", f"sqlite:///{text}"])
        assert result.exit_code == 1 and "is not an Orbit database" in result.stderr, (args, result.output)
        assert "Traceback" not in result.output
