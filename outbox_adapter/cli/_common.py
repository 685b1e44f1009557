"""What every ``orbit-outbox`` command shares: the consoles, the exit codes of ``cli``'s docstring,
the error mapping, the outbox it opens, and the row tables and JSON it prints.

Imports no command module: the commands import these.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn
from rich.table import Table

from orbit_client import OrbitError
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxRowError, OutboxUsageError
from outbox_adapter._manager import Outbox
from outbox_adapter._models import OutboxRow
from outbox_adapter._tables import OutboxTables

__all__ = ["EXIT_DATABASE", "EXIT_ORBIT", "EXIT_REFUSED", "EXIT_USAGE", "err", "out"]

EXIT_REFUSED, EXIT_USAGE, EXIT_DATABASE, EXIT_ORBIT = 1, 2, 3, 4

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True)
    sys.exit(code)


@contextmanager
def _errors() -> Iterator[None]:
    """Map the adapter's errors to a message on stderr and the exit code of this module's docstring."""
    try:
        yield
    except OutboxUsageError as exc:
        _fail(str(exc), EXIT_USAGE)
    except OutboxRowError as exc:
        _fail(str(exc), EXIT_REFUSED)
    except OutboxDatabaseError as exc:
        _fail(str(exc), EXIT_DATABASE)
    except OrbitError as exc:
        _fail(str(exc), EXIT_ORBIT)


@contextmanager
def _outbox(database_url: str, table: str, inbox_table: str | None = None) -> Iterator[Outbox]:
    with _errors():
        outbox = Outbox(
            database_url=database_url, tables=OutboxTables(name=table, inbox_name=inbox_table), pool_size=2
        )
    try:
        with _errors():
            yield outbox
    finally:
        outbox.close()


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def _cells(*values: str) -> list[str]:
    """Table cells with their ``[`` escaped: user text is never read as rich markup."""
    return [escape(v) for v in values]


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    return text if len(text) <= width else text[: width - 1] + "…"


def _rows_table(rows: list[OutboxRow], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (
        "id",
        "state",
        "key",
        "queue",
        "handler",
        "attempts",
        "available at (UTC)",
        "task",
        "last error",
    ):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            *_cells(
                str(row.id),
                row.state,
                row.idempotency_key,
                f"{row.namespace}/flow:{row.flow}" if row.kind == "flow" else f"{row.namespace}/{row.queue}",
                "(flow start)" if row.kind == "flow" else row.handler,
                f"{row.attempts}/{row.max_attempts or '-'}",
                row.available_at.strftime("%Y-%m-%d %H:%M:%S"),
                row.orbit_task_id or "",
                _short(row.last_error),
            )
        )
    return table


def _row_dict(row: OutboxRow, *, with_params: bool) -> dict[str, Any]:
    data = row.to_dict()
    data.pop("lease_token", None)
    if not with_params:
        data.pop("params", None)
    return data


@contextmanager
def _progress(what: str) -> Iterator[Callable[[int], None]]:
    """A spinner with a count on a terminal (stderr); nothing otherwise."""
    with Progress(
        SpinnerColumn(),
        TextColumn(f"{what}: {{task.completed}} rows"),
        console=err,
        disable=not err.is_terminal,
        transient=True,
    ) as progress:
        task = progress.add_task(what, total=None)
        yield lambda n: progress.advance(task, n)
