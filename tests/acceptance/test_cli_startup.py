"""`--help` starts fast because it imports only what a command needs when it runs (issue 23: `import
orbit_server.cli` loaded alembic, SQLAlchemy's engine and the whole client with its flow models just to print
help, 2.2 s under load; `import outbox_adapter` did the same for `orbit-outbox --help`, 1.2 s on a quiet
machine). Not a timed test: it checks what `--help` imports, in a fresh interpreter, through the console
script's entry point (pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules a command imports when it runs, never for `--help`.
HEAVY = ("alembic", "sqlalchemy.engine", "sqlalchemy.orm", "fastapi", "uvicorn", "orbit_client._flow_models",
         "orbit_client._client", "rich.table", "prometheus_client", "httpx")  # fmt: skip
#: And for `orbit-outbox --help`: the client (it is imported whole), pydantic, rich, and the adapter's own
#: relay, consumer and operator modules (`orbit-server --help` needs pydantic-settings for its options).
OUTBOX_HEAVY = ("orbit_client", "pydantic", "pydantic_settings", "rich", "outbox_adapter._relay",
                "outbox_adapter._consumer", "outbox_adapter._manager", "outbox_adapter.cli._common")  # fmt: skip

PROBE = """
import json, sys
from {module} import main
sys.argv = [{prog!r}, *{args!r}]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {roots!r})}}))
"""


def _loaded_by(module: str, prog: str, args: list[str], heavy: tuple[str, ...]) -> tuple[int, set[str]]:
    roots = sorted({name.split(".")[0] for name in heavy})
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, prog=prog, args=args, roots=roots)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Usage: {prog} "), done.stdout[:200]
    report = json.loads(done.stdout.splitlines()[-1])
    return report["code"], set(report["loaded"])


@pytest.mark.parametrize(
    ("module", "prog", "args", "heavy"),
    [
        ("orbit_server._entry", "orbit-server", ["--help"], HEAVY),
        ("outbox_adapter._entry", "orbit-outbox", ["--help"], HEAVY + OUTBOX_HEAVY),
    ],
    ids=["orbit-server --help", "orbit-outbox --help"],
)
def test_help_imports_nothing_a_command_needs_only_when_it_runs(
    module: str, prog: str, args: list[str], heavy: tuple[str, ...]
) -> None:
    code, loaded = _loaded_by(module, prog, args, heavy)
    assert code in (0, None)
    found = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in heavy))
    assert found == [], f"`{prog} {' '.join(args)}` imported {found}"


def test_a_command_whose_dependency_is_missing_still_names_the_extra() -> None:
    """The commands are imported when one runs, after the entry point's own imports: a missing outbox
    dependency (here SQLAlchemy, on an install with click) still says which extra, without a traceback."""
    probe = (
        "import sys; sys.modules['sqlalchemy'] = None\n"
        "from outbox_adapter._entry import main\n"
        "sys.argv = ['orbit-outbox', 'status', '--database-url', 'sqlite://']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'orbit-tasks[outbox]'" in done.stderr and "Traceback" not in done.stderr
