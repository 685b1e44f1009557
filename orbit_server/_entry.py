"""The ``orbit-server`` command's entry point: says which extra to install when the server's
dependencies are missing (a client-only ``pip install orbit``) instead of a traceback."""

from __future__ import annotations

import sys

__all__ = ["main"]

#: Top-level modules of the ``server`` extra's dependencies (pyproject.toml).
_SERVER_DEPENDENCIES = frozenset(
    {"fastapi", "uvicorn", "sqlalchemy", "alembic", "click", "pydantic_settings", "rich", "prometheus_client",
     "jinja2", "itsdangerous", "starlette"}
)  # fmt: skip


def main() -> None:
    """Run ``orbit-server``; exit 2 with the install command when a server dependency is missing."""
    try:
        from orbit_server.cli import main as cli_main
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in _SERVER_DEPENDENCIES:
            raise
        sys.stderr.write(
            f"error: orbit-server needs the server extra ({missing!r} is not installed); "
            "install it with: pip install 'orbit[server]' (add ',mysql' for MariaDB/MySQL)\n"
        )
        sys.exit(2)
    cli_main()
