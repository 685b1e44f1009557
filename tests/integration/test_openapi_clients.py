"""The OpenAPI document is a contract for clients nobody here wrote (issue 29): clients generated from the
document a live server serves, in TypeScript (openapi-typescript + openapi-fetch) and Python
(openapi-python-client), come out without a warning and type-check a small protocol script each (submit,
replay, lease, start, complete, an error body's ``code``); the Python one also runs it against the server.
The document passes ``openapi-spec-validator`` and a Redocly lint with no error.

The npm tools are pinned in ``tests/openapi_clients/package-lock.json`` (TypeScript 5: TypeScript 7 breaks
openapi-typescript 7.13); ``.ci/run`` installs them with ``npm ci``. Without them these tests skip, and fail
under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate

from tests.servers import RunningServer, run_server

TOOLS = Path(__file__).resolve().parents[1] / "openapi_clients"
BIN = TOOLS / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path, str]]:
    from sqlalchemy.engine import make_url

    where = tmp_path_factory.mktemp("openapi")
    with run_server(make_url(f"sqlite:///{where}/orbit.db")) as server:
        keys = server.add_namespace("shop", ("fulfilment",))
        document = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()
        path = where / "openapi.json"
        path.write_text(json.dumps(document, indent=2))
        yield server, path, keys["admin"]


def _npm_tool(name: str) -> Path:
    tool = BIN / name
    if not tool.exists():
        message = f"{tool} is missing: run `npm ci --prefix tests/openapi_clients` (as .ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return tool


def _run(argv: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": path, "REDOCLY_TELEMETRY": "off", "NO_COLOR": "1", **env},
    )  # fmt: skip


def test_the_document_is_valid_openapi(served: tuple[RunningServer, Path, str]) -> None:
    _, document, _ = served
    validate(json.loads(document.read_text()))


def test_a_redocly_lint_finds_no_error(served: tuple[RunningServer, Path, str]) -> None:
    _, document, _ = served
    linted = _run([_npm_tool("redocly"), "lint", document, "--format", "stylish"], cwd=TOOLS)
    assert linted.returncode == 0 and " error " not in linted.stdout, linted.stdout + linted.stderr


def test_a_typescript_client_type_checks_the_protocol(
    served: tuple[RunningServer, Path, str], tmp_path: Path
) -> None:
    _, document, _ = served
    generated = _run(
        [
            _npm_tool("openapi-typescript"),
            document,
            "--default-non-nullable=false",
            "-o",
            tmp_path / "orbit.d.ts",
        ],
        cwd=TOOLS,
    )
    output = generated.stdout + generated.stderr
    assert generated.returncode == 0 and "✘" not in output and "⚠" not in output, output
    for name in ("protocol.ts", "tsconfig.json"):
        shutil.copy(TOOLS / name, tmp_path / name)
    (tmp_path / "node_modules").symlink_to(TOOLS / "node_modules")
    checked = _run([_npm_tool("tsc"), "-p", tmp_path / "tsconfig.json"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_python_client_type_checks_and_runs_the_protocol(
    served: tuple[RunningServer, Path, str], tmp_path: Path
) -> None:
    server, document, key = served
    package = tmp_path / "orbit_generated"
    generated = _run(
        ["openapi-python-client", "generate", "--path", document, "--output-path", package, "--meta", "none"],
        cwd=tmp_path,
    )
    output = generated.stdout + generated.stderr
    assert generated.returncode == 0 and "Warning" not in output and "Unable" not in output, output
    shutil.copy(TOOLS / "protocol.py", tmp_path / "protocol.py")
    # The script is checked strictly; the generator's own modules are its business.
    checked = _run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--no-incremental",
            "protocol.py",
        ],
        cwd=tmp_path,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    ran = _run([sys.executable, "protocol.py", server.base_url, key], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "201 WAITING", "replayed: true", "completed: SUCCEEDED", "idempotency_key_reused"
    ], ran.stdout  # fmt: skip
