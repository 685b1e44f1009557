"""What every ``orbit-outbox`` command shares: the consoles, the exit codes of ``cli``'s docstring,
the error mapping, the outbox it opens, and the row tables and JSON it prints.

Imports no command module: the commands import these.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
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


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    return text if len(text) <= width else text[: width - 1] + "…"


def _piped() -> bool:
    """stdout is not a terminal (a pipe, a file, click's CliRunner): tables print as tab-separated lines."""
    return not sys.stdout.isatty()


def _gap() -> None:
    """Piped, a blank line between two blocks of a command's output (a terminal has the tables' borders)."""
    if _piped():
        click.echo("")


#: Piped, a cell's tabs and line breaks become spaces: one row a line, one cell a column.
_ONE_LINE = str.maketrans({"\t": " ", "\n": " ", "\r": " "})


def _print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    title: str | None = None,
    short: Mapping[str, int] | None = None,
    right: Collection[str] = (),
    header: bool = True,
) -> None:
    """Rows as a rich table on a terminal; piped, tab-separated lines under one header line (whole values,
    one row a line, no title), as the server's listings are. Every listing of ``orbit-outbox`` prints here.

    On a terminal only: ``title`` above the table, the columns of ``short`` cut to that many characters,
    those of ``right`` right-justified, and with ``header=False`` a key/value table (no header, keys bold).
    Cells are text, never rich markup.
    """
    if _piped():
        click.echo("\t".join(columns))
        for row in rows:
            click.echo("\t".join(c.translate(_ONE_LINE) for c in row))
        return
    cut = short or {}
    table = Table(title=escape(title) if title else None, title_justify="left", show_header=header)
    for i, column in enumerate(columns):
        table.add_column(
            column,
            overflow="fold",
            justify="right" if column in right else "left",
            style="bold" if not header and i == 0 else None,
        )
    for row in rows:
        table.add_row(
            *(escape(_short(c, cut[col]) if col in cut else c) for col, c in zip(columns, row, strict=True))
        )
    out.print(table)


_ROW_COLUMNS = (
    "id",
    "state",
    "key",
    "queue",
    "handler",
    "attempts",
    "available at (UTC)",
    "task",
    "last error",
)


def _row_cells(row: OutboxRow) -> list[str]:
    """A row's cells; ``available at`` only for a PENDING row (the next send's due time: for any other state
    it is the backoff of a send that has since been answered, a time that means nothing)."""
    return [
        str(row.id),
        row.state,
        row.idempotency_key,
        f"{row.namespace}/flow:{row.flow}" if row.kind == "flow" else f"{row.namespace}/{row.queue}",
        "(flow start)" if row.kind == "flow" else row.handler,
        f"{row.attempts}/{row.max_attempts or '-'}",
        row.available_at.strftime("%Y-%m-%d %H:%M:%S") if row.state == "PENDING" else "",
        row.orbit_task_id or "",
        row.last_error or "",
    ]


def _print_rows(rows: list[OutboxRow], title: str) -> None:
    """Outbox rows as a table (the last error cut to 60 characters on a terminal, whole when piped)."""
    _print_table(_ROW_COLUMNS, [_row_cells(row) for row in rows], title=title, short={"last error": 60})


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
