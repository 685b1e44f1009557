"""`--help` starts fast because it imports only what a command needs when it runs (issue 23: `import
orbit_server.cli` loaded alembic, SQLAlchemy's engine and the whole client with its flow models just to print
help, 2.2 s under load). Not a timed test: it checks what `--help` imports, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules a command imports when it runs, never for `--help`.
HEAVY = ("alembic", "sqlalchemy.engine", "sqlalchemy.orm", "fastapi", "uvicorn", "orbit_client._flow_models",
         "orbit_client._client", "rich.table", "prometheus_client", "httpx")  # fmt: skip

PROBE = """
import json, sys
from {module} import main
try:
    main({args!r})
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {roots!r})}}))
"""


def _loaded_by(module: str, args: list[str]) -> tuple[int, set[str]]:
    roots = sorted({name.split(".")[0] for name in HEAVY})
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, args=args, roots=roots)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    return report["code"], set(report["loaded"])


@pytest.mark.parametrize(("module", "args"), [("orbit_server.cli", ["--help"])], ids=["orbit-server --help"])
def test_help_imports_nothing_a_command_needs_only_when_it_runs(module: str, args: list[str]) -> None:
    code, loaded = _loaded_by(module, args)
    assert code in (0, None)
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], f"`{' '.join(args)}` imported {heavy}"
