"""The ``orbit-outbox`` command's entry point: says which extra to install when the outbox's
dependencies are missing (a client-only ``pip install orbit-tasks``) instead of a traceback."""

from __future__ import annotations

import sys

from outbox_adapter import _OUTBOX_DEPENDENCIES

__all__ = ["main"]


def main() -> None:
    """Run ``orbit-outbox``; exit 2 with the install command when an outbox dependency is missing."""
    try:
        from outbox_adapter.cli import main as cli_main

        cli_main()  # a command imports what it needs (SQLAlchemy, rich, ...) when it runs
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in _OUTBOX_DEPENDENCIES:
            raise
        sys.stderr.write(
            f"error: orbit-outbox needs the outbox extra ({missing!r} is not installed); "
            "install it with: pip install 'orbit-tasks[outbox]' (add ',mysql' for MariaDB/MySQL, "
            "',postgres' for PostgreSQL)\n"
        )
        sys.exit(2)
