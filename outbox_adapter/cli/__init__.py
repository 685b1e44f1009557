"""``orbit-outbox``: migrate, relay, inspect and repair the outbox of a business database,
and consume result events into its inbox.

Every option can also be set through the environment variable shown in ``--help``
(``ORBIT_OUTBOX_DATABASE_URL``, ``ORBIT_URL``, ``ORBIT_API_KEY``, ``ORBIT_NAMESPACE``, ...). On a terminal
the output is rich tables; piped, tab-separated lines under a header line (``cli._common._print_table``);
``--json`` prints JSON for scripts.

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

from typing import TYPE_CHECKING, Any

import click

from outbox_adapter.cli._lazy import LazyGroup
from outbox_adapter.cli._options import parse_duration

if TYPE_CHECKING:
    from outbox_adapter.cli._run import load_handler

__all__ = ["load_handler", "main", "parse_duration"]

_RUN, _ROWS, _REPAIR = "outbox_adapter.cli._run", "outbox_adapter.cli._rows", "outbox_adapter.cli._repair"

#: The commands, each imported from its module when it runs or shows its own help (``orbit-outbox --help``
#: imports none of them, nor SQLAlchemy, Alembic, rich's tables or the client they import).
_COMMANDS = {
    "abandon": (
        _REPAIR,
        "abandon",
        "Give up a DEAD or NEEDS_RECONCILE row for good: → ABANDONED (never sent), audited.",
    ),
    "consume": (
        _RUN,
        "consume",
        "Apply the result events of a subscription to the business database, once each (inbox), until SIGTERM "
        "(or, with --once, until nothing is due). Acks only after the commit.",
    ),
    "list": (_ROWS, "list_command", "List rows by id (params are never shown here)."),
    "migrate": (
        _RUN,
        "migrate",
        "Create or upgrade the outbox and inbox tables (Alembic, version table <table>_alembic_version).",
    ),
    "purge": (
        _REPAIR,
        "purge",
        "Delete old DELIVERED rows and their events, or DEAD rows that must not be sent (each keeps its audit "
        "trail plus a DEAD → PURGED event with actor and reason), in batches. Never touches another state.",
    ),
    "reconcile": (
        _REPAIR,
        "reconcile",
        "Settle NEEDS_RECONCILE rows by their original key: found → DELIVERED, not found → PENDING. Rows it "
        "cannot decide (mismatch, too_old) stay for a person: see `resolve`.",
    ),
    "relay": (
        _RUN,
        "relay",
        "Deliver outbox rows to Orbit until SIGTERM (or, with --once, until nothing is due).",
    ),
    "resolve": (
        _REPAIR,
        "resolve",
        "Settle a NEEDS_RECONCILE row that reconcile left to a person (key of a different submission, or older "
        "than the key window): --delivered-as TASK_ID → DELIVERED, or --abandon → ABANDONED. Audited.",
    ),
    "retry": (
        _REPAIR,
        "retry",
        "Send a DEAD row again with the same key (DEAD → PENDING, audited). Fix the cause first.",
    ),
    "show": (_ROWS, "show", "One row and its audit trail."),
    "status": (
        _ROWS,
        "status",
        "Rows per state, leased rows, the oldest pending row's age (s), the next due time (UTC), and the ordering "
        "keys blocked by a DEAD or NEEDS_RECONCILE row (with that row).",
    ),
}


@click.group(
    cls=LazyGroup,
    lazy=_COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
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
    from outbox_adapter._logging import configure_logging  # imports the client: not for --help

    configure_logging(log_level, log_format)


def _load(name: str) -> Any:
    if name == "load_handler":  # re-exported for tests and scripts; it imports the relay's world
        from outbox_adapter.cli._run import load_handler

        return load_handler
    raise AttributeError(f"module 'outbox_adapter.cli' has no attribute {name!r}")


if not TYPE_CHECKING:  # for type checkers the module has exactly the names above
    __getattr__ = _load
