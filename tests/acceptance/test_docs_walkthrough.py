"""The documentation, followed top to bottom in one shell, runs clean (issue 23, first hour; issue 29: the
README's walkthrough moved into the site's pages).

The README and then every page of the site in the order of its navigation (``mkdocs.yml``: the tutorials,
then the how-to guides, ...) are read as one text. Every ``sh`` block of them carries a marker comment on the line before it that says what a reader does
with it: ``run`` (in order, in one bash session whose variables carry over), ``background, ready at URL`` or
``background, ready when stdout says "TEXT"`` (a second shell: the server, the worker), ``sqlite`` / ``mariadb`` / ``postgres``
(the database choice: only the chosen one runs) or ``skip (why)``. An unmarked block fails the test, so a new
block is a decision. ``pip install`` lines are checked (their extras exist in ``pyproject.toml``) rather than
run. Only the port and, on MariaDB and PostgreSQL, the database's name and the server's address are changed.

The walkthrough fails on any error: a command's non-zero exit, a background process that dies, a task that ends
``FAILED`` (a handler no worker has), an example the blocks never run. A marker may stand indented before an
indented block (a step of a numbered list).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from tests.docs_pages import nav_pages
from tests.server_processes import free_port

REPO = Path(__file__).resolve().parents[2]
#: What a reader follows, in order: the README, then the site's pages in the order of its navigation.
PAGES = ["README.md", *(f"docs/{path}" for path in nav_pages())]
EXTRAS = set(tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]["optional-dependencies"])
DOCS_PORT = "8080"
DOCS_MARIADB = 'mariadb -h 127.0.0.1 -u root -e "CREATE DATABASE orbit '
DOCS_MARIADB_URL = "mysql+pymysql://root@127.0.0.1/orbit"
DOCS_POSTGRES = 'psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE orbit'
DOCS_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1/orbit"
_BLOCK = re.compile(
    r"(?:<!-- walkthrough: (?P<marker>.*?) -->\n[ \t]*)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S
)


@dataclass(frozen=True)
class Block:
    marker: str
    lang: str
    body: str
    line: str  # where it is: "docs/tutorials/first-hour.md:12"


def _blocks() -> list[Block]:
    blocks = []
    for name in PAGES:
        text = (REPO / name).read_text(encoding="utf-8")
        blocks += [
            Block(m["marker"] or "", m["lang"], m["body"], f"{name}:{text.count(chr(10), 0, m.start()) + 1}")
            for m in _BLOCK.finditer(text)
        ]
    return blocks


def _checked_pip(body: str) -> str:
    """``pip install`` lines: their extras must exist (the distribution's own name too); not run."""
    kept = []
    for line in body.splitlines():
        if not line.startswith("pip install"):
            kept.append(line)
            continue
        for spec in re.findall(r"(?:\.|orbit-tasks)\[([\w,]+)\]", line):
            unknown = set(spec.split(",")) - EXTRAS
            assert not unknown, f"the docs' line {line!r} names extras pyproject.toml lacks: {unknown}"
        assert re.search(r"pip install (?:'\.|\.|'orbit-tasks)", line), line
    return "\n".join(kept) + "\n"


def test_every_sh_block_says_what_a_reader_does_with_it() -> None:
    unmarked = [b.line for b in _blocks() if b.lang == "sh" and not b.marker]
    assert unmarked == [], f"sh blocks without a walkthrough marker, at {unmarked}"
    for block in _blocks():
        if block.marker:
            assert re.fullmatch(
                r"run|sqlite|mariadb|postgres|skip \(.+\)|background, ready (at http://\S+|when stdout says \".+\")",
                block.marker,
            ), f"{block.line}: unknown walkthrough marker {block.marker!r}"


def test_every_example_shown_is_run_by_the_walkthrough() -> None:
    commands = "\n".join(b.body for b in _blocks() if b.marker == "run" or b.marker.startswith("background"))
    for block in _blocks():
        if block.lang == "python" and block.body.startswith("# examples/"):
            path = block.body.splitlines()[0].removeprefix("# ")
            assert f"python {path}" in commands, f"{block.line} shows {path} but no block runs it"


class Walkthrough:
    """One reader's shell: the variables of each block carry over to the next (``env.sh``)."""

    def __init__(self, workdir: Path, substitutions: dict[str, str]) -> None:
        self.workdir = workdir
        self.substitutions = substitutions
        self.state = workdir / "env.sh"
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("ORBIT_") or k.startswith("ORBIT_TEST")
        }
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        self.env = env
        self.state.write_text("")
        self.background: list[tuple[subprocess.Popen[str], list[str]]] = []
        self.outputs: list[tuple[str, str]] = []

    def _script(self, body: str) -> str:
        for old, new in self.substitutions.items():
            body = body.replace(old, new)
        return _checked_pip(body)

    def run(self, block: Block) -> str:
        script = (
            f"set -euo pipefail\nset -a\nsource {shlex.quote(str(self.state))}\n{self._script(block.body)}"
        )
        script += f"\nexport -p > {shlex.quote(str(self.state))}\n"
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, (
            f"the block at {block.line} exited {done.returncode}:\n{block.body}\n"
            f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}\n{self._background_logs()}"
        )
        self.outputs.append((block.body, done.stdout))
        return done.stdout

    def start(self, block: Block) -> None:
        script = f"set -a\nsource {shlex.quote(str(self.state))}\n{self._script(block.body)}"
        process = subprocess.Popen(
            ["bash", "-c", script], cwd=self.workdir, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        lines: list[str] = []
        arrived: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                arrived.put(line)

        threading.Thread(target=read, daemon=True).start()
        self.background.append((process, lines))
        ready = block.marker.removeprefix("background, ready ")
        for old, new in self.substitutions.items():
            ready = ready.replace(old, new)
        deadline = time.monotonic() + 90
        if ready.startswith("at "):
            url = ready.removeprefix("at ")
            while True:
                assert process.poll() is None, f"{block.line}: exited\n{''.join(lines)}"
                assert time.monotonic() < deadline, f"{url} never answered\n{''.join(lines)}"
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)  # polling a port: there is no event to await across processes
        text = ready.removeprefix("when stdout says ").strip('"')
        while True:
            try:
                line = arrived.get(timeout=0.5)
            except queue.Empty:
                assert process.poll() is None, f"{block.line}: exited\n{''.join(lines)}"
                assert time.monotonic() < deadline, f"{block.line} never said {text!r}"
                continue
            if text in line:
                return

    def _background_logs(self) -> str:
        return "\n".join(f"background log:\n{''.join(lines)[-4000:]}" for _, lines in self.background)

    def stop(self, *, check: bool) -> None:
        for process, lines in self.background:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
            assert not check or process.returncode in (0, -signal.SIGTERM), (
                f"exited {process.returncode}:\n{''.join(lines)}"
            )


@pytest.fixture(params=["sqlite", "mariadb", "postgres"])
def database(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, str]]]:
    if request.param == "sqlite":
        yield "sqlite", {}
        return
    if request.param == "postgres":
        yield from _postgres(request.getfixturevalue("postgres_server"))
        return
    server: URL = request.getfixturevalue("mysql_server")
    name = f"orbit_readme_{uuid.uuid4().hex[:10]}"
    client = (
        f"mariadb -h {server.host or '127.0.0.1'} -P {server.port or 3306} -u {server.username or 'root'}"
    )
    if server.password:
        client += f" -p{server.password}"
    subs = {
        DOCS_MARIADB: f'{client} -e "CREATE DATABASE {name} ',
        DOCS_MARIADB_URL: server.set(database=name).render_as_string(hide_password=False),
    }
    try:
        yield "mariadb", subs
    finally:
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def _postgres(server: URL) -> Iterator[tuple[str, dict[str, str]]]:
    name = f"orbit_readme_{uuid.uuid4().hex[:10]}"
    client = (
        f"psql -h {server.host or '127.0.0.1'} -p {server.port or 5432} -U {server.username or 'postgres'}"
    )
    subs = {
        DOCS_POSTGRES: f'{client} -c "CREATE DATABASE {name}',
        DOCS_POSTGRES_URL: server.set(database=name).render_as_string(hide_password=False),
    }
    try:
        yield "postgres", subs
    finally:
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_the_docs_run_top_to_bottom(tmp_path: Path, database: tuple[str, dict[str, str]]) -> None:
    kind, substitutions = database
    blocks = _blocks()
    chosen = [b for b in blocks if b.marker == kind]
    assert len(chosen) == 1, f"the docs have {len(chosen)} {kind!r} blocks"
    if kind != "sqlite":
        assert all(old in chosen[0].body for old in substitutions), chosen[0].body
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the examples by the paths the docs give
    port = str(free_port())
    walk = Walkthrough(tmp_path, {**substitutions, DOCS_PORT: port})
    try:
        for block in blocks:
            if block.marker in ("run", kind):
                walk.run(block)
            elif block.marker.startswith("background"):
                walk.start(block)
        # Nothing the docs made failed: every task it created had a handler (no unknown_handler), and the
        # inbox example saw its order completed.
        failed = walk.run(
            Block(
                "run", "sh", "orbit-server task list --namespace shop --status FAILED --json\n", "the check"
            )
        )
        assert json.loads(failed)["items"] == [], failed
        [inbox] = [out for body, out in walk.outputs if "examples/inbox_example.py" in body]
        # Every result event of the subscription is applied (the other examples' tasks change no order).
        assert inbox.split()[-1] == "COMPLETED" and int(inbox.split()[0]) >= 1, inbox
    except BaseException:
        walk.stop(check=False)
        raise
    walk.stop(check=True)
    assert sorted(p.name for p in tmp_path.glob("*.db")) == (
        ["orbit.db", "shop.db"] if kind == "sqlite" else ["shop.db"]
    )
