"""What `pip install .` gives: the client alone, without SQLAlchemy or a driver (DESIGN §1)."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("orbit_tasks-*.whl")
    return built


def test_wheel_ships_typing_marker_and_migrations(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "orbit_client/py.typed" in names and "orbit_server/py.typed" in names
    assert "orbit_server/_migrations/env.py" in names
    assert any(n.startswith("orbit_server/_migrations/versions/0001") for n in names)
    # The web console's templates and stylesheet ship in the package (no CDN, no build step).
    assert "orbit_server/console/templates/base.html" in names
    assert "orbit_server/console/static/console.css" in names


def test_plain_install_is_the_client_without_sqlalchemy(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)], check=True, capture_output=True
    )
    probe = (
        "import importlib.util, orbit_client;"
        "assert importlib.util.find_spec('sqlalchemy') is None, 'sqlalchemy was installed';"
        "assert importlib.util.find_spec('fastapi') is None, 'fastapi was installed';"
        "print(orbit_client.__version__, orbit_client.OrbitClient.__name__)"
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.1.0", "OrbitClient"]
    # The server's command is installed too: it names the extra to install instead of a traceback.
    server_cli = subprocess.run(
        [str(env_dir / "bin" / "orbit-server"), "--help"], capture_output=True, text=True
    )
    assert server_cli.returncode == 2, server_cli.stderr
    assert "pip install 'orbit-tasks[server]'" in server_cli.stderr and "Traceback" not in server_cli.stderr
    # So is the outbox's (regression, issue 10: it crashed with ModuleNotFoundError: sqlalchemy).
    for args in (["--help"], ["relay", "--database-url", "sqlite:///x.db"]):
        outbox_cli = subprocess.run(
            [str(env_dir / "bin" / "orbit-outbox"), *args], capture_output=True, text=True
        )
        assert outbox_cli.returncode == 2, outbox_cli.stderr
        assert (
            "pip install 'orbit-tasks[outbox]'" in outbox_cli.stderr and "Traceback" not in outbox_cli.stderr
        )
    # Using the outbox from Python on that install names the extra too.
    probe = "import outbox_adapter\ntry:\n    outbox_adapter.enqueue\nexcept ModuleNotFoundError as e:\n    print(e)"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0 and "pip install 'orbit-tasks[outbox]'" in done.stdout, done.stderr
