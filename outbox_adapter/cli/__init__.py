"""``orbit-outbox``: migrate, relay, inspect and repair the outbox of a business database,
and consume result events into its inbox.

Every option can also be set through the environment variable shown in ``--help``
(``ORBIT_OUTBOX_DATABASE_URL``, ``ORBIT_URL``, ``ORBIT_API_KEY``, ``ORBIT_NAMESPACE``, ...). On a terminal
the output is rich tables; ``--json`` prints JSON for scripts.

Exit codes:

- ``0``: done.
- ``1``: refused: no such row, or its state does not allow the command (or, for ``resolve
  --delivered-as``, no such task); for ``reconcile``, some rows need a person (``mismatch``,
  ``too_old``: settle them with ``resolve``).
- ``2``: bad usage (an unknown option, a malformed value or URL, a ``--handler`` that cannot be imported).
- ``3``: the business database is unreachable, failed, or has no outbox tables (run ``migrate``).
- ``4``: the Orbit server is unreachable or refused the request (``relay --once`` rows left unsent,
  ``reconcile`` lookups, ``resolve --delivered-as`` task checks, ``consume`` leases).
"""

from __future__ import annotations

import click

from outbox_adapter._logging import configure_logging
from outbox_adapter.cli import _repair, _rows, _run
from outbox_adapter.cli._options import parse_duration
from outbox_adapter.cli._run import load_handler

__all__ = ["load_handler", "main", "parse_duration"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--log-level",
    envvar="ORBIT_OUTBOX_LOG_LEVEL",
    show_envvar=True,
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
@click.option(
    "--log-format",
    envvar="ORBIT_OUTBOX_LOG_FORMAT",
    show_envvar=True,
    default="text",
    show_default=True,
    type=click.Choice(["text", "json"]),
    help="Logs on stderr as text lines or JSON objects (row id, key and task id as fields; never params).",
)
@click.version_option("0.1.0", prog_name="orbit-outbox")
def main(log_level: str, log_format: str) -> None:
    """Transactional outbox for Orbit: rows written with the business change, delivered by a relay;
    result events consumed into an inbox, applied once each.

    Exit codes: 0 done, 1 refused (no such row, wrong state, rows needing a person),
    2 bad usage, 3 business database unreachable or not migrated, 4 Orbit server
    unreachable or refusing.
    """
    configure_logging(log_level, log_format)


for _command in (
    _run.migrate,
    _run.relay,
    _run.consume,
    _rows.status,
    _rows.list_command,
    _rows.show,
    _repair.retry,
    _repair.reconcile,
    _repair.resolve,
    _repair.abandon,
    _repair.purge,
):
    main.add_command(_command)
del _command
