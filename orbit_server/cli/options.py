"""Options and output helpers shared by the ``orbit-server`` commands: ``--database-url``, ``--json``,
``--actor``, the engine context, name checks, tables. Imports no command module, so every command
module can import it.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import click

from orbit_server import errors
from orbit_server.settings import ServerSettings

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

# SQLAlchemy, Alembic and the areas are imported by the functions that use them, when a command runs:
# `orbit-server --help` imports none of them (issue 23).

F = TypeVar("F", bound=Callable[..., Any])
_DEFAULTS = ServerSettings.model_fields


def _database_url_option(func: F) -> F:
    return click.option(
        "--database-url",
        envvar="ORBIT_DATABASE_URL",
        show_envvar=True,
        default=_DEFAULTS["database_url"].default,
        show_default=True,
        help="SQLAlchemy URL of the server database.",
    )(func)


@contextmanager
def _engine(
    url: str, *, ensure_schema: bool = True, raise_unreachable: bool = False, create_sqlite: bool = False
) -> Iterator[Engine]:
    """An engine for one command.

    With ``ensure_schema``, an existing SQLite file is migrated first and a missing one stops the
    command with exit code 1 (a typo in the URL must not make a new, empty database; ``migrate``,
    and ``serve`` through ``create_sqlite``, create it); any other database must already be at
    the newest revision, or the command stops with exit code 1 and says to run ``orbit-server
    migrate``. A SQLite file that is no database stops it with exit code 1. A database that
    cannot be used (``sqlalchemy.exc.OperationalError``: unreachable, refusing statements)
    stops the command with exit code 3, or, with ``raise_unreachable``, raises that error to
    the caller.
    """
    import sqlalchemy as sa

    from orbit_server.db import migrate as _migrate
    from orbit_server.db.engine import create_engine, is_sqlite

    if ensure_schema and is_sqlite(url) and not create_sqlite:
        path = sa.make_url(url).database
        if path and path != ":memory:" and not path.startswith("file:") and not os.path.exists(path):
            # A typo in ORBIT_DATABASE_URL made a new, empty database here.
            click.echo(
                f"error: there is no SQLite database at {os.path.abspath(path)}; check --database-url "
                "(ORBIT_DATABASE_URL), or create it with `orbit-server migrate` (`orbit-server serve` does it too)",
                err=True,
            )
            sys.exit(1)
    try:
        engine = create_engine(url, pool_size=2)
    except (ValueError, sa.exc.ArgumentError, ImportError) as exc:
        raise click.UsageError(f"--database-url: {exc}") from exc
    try:
        if ensure_schema and is_sqlite(url):
            _migrate.upgrade(engine)
        elif ensure_schema:
            current, head = _migrate.current_revision(engine), _migrate.head_revision()
            if current != head:
                click.echo(
                    f"error: the database schema is at revision {current or 'none'}, the newest is {head}; "
                    f"run `orbit-server migrate --database-url ...` first",
                    err=True,
                )
                sys.exit(1)
        yield engine
    except errors.OrbitServerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except sa.exc.OperationalError as exc:
        if raise_unreachable:
            raise
        reason = " ".join(str(exc.orig).split())  # one line (psycopg's messages span several)
        click.echo(
            f"error: cannot use the database at {sa.make_url(url).render_as_string()}: {reason}", err=True
        )
        sys.exit(3)
    except sa.exc.DatabaseError as exc:
        # SQLite's "file is not a database" (exactly DatabaseError: not an IntegrityError and the like)
        if not is_sqlite(url) or type(exc.orig) is not sqlite3.DatabaseError:
            raise
        click.echo(
            f"error: {sa.make_url(url).render_as_string()} is not an Orbit database ({exc.orig}); check "
            "--database-url (ORBIT_DATABASE_URL)",
            err=True,
        )
        sys.exit(1)
    finally:
        engine.dispose()


def _check_label(label: str | None) -> str | None:
    from orbit_server.tasks import store

    if label is not None and len(label) > store.API_KEY_LABEL_MAX_LENGTH:
        raise click.BadParameter(
            f"the label has {len(label)} characters; the limit is {store.API_KEY_LABEL_MAX_LENGTH}: "
            "shorten it (nothing was written)",
            param_hint="'--label'",
        )
    return label


def _check_name(what: str, name: str) -> None:
    import re

    from orbit_client import NAME_PATTERN

    if not re.fullmatch(NAME_PATTERN, name):
        raise click.BadParameter(
            "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit", param_hint=what
        )


# ------------------------------------------------------------------ output


def _json_option(func: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of a table."
    )(func)


#: Longest ``--actor``: the audit trail's ``actor`` column.
ACTOR_MAX_LENGTH = 255


def _check_actor(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None and len(value) > ACTOR_MAX_LENGTH:
        raise click.BadParameter(
            f"is {len(value)} characters long; at most {ACTOR_MAX_LENGTH} fit the audit trail"
        )
    return value


def _actor_option(func: F) -> F:
    return click.option(
        "--actor",
        envvar="ORBIT_ADMIN_ACTOR",
        show_envvar=True,
        default=None,
        callback=_check_actor,
        help="Who acts, for the task's history. Default: cli:<login name> (at most 255 characters).",
    )(func)


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli:unknown"


def _plain(value: Any) -> Any:
    """A value as JSON holds it: datetimes in ISO 8601 UTC, dataclasses and models as objects."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):  # enums
        return value.value
    return value


def _print_json(data: Any) -> None:
    click.echo(json.dumps(_plain(data), indent=2, ensure_ascii=False))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    if hasattr(value, "value") and isinstance(value.value, str):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    """Rows as a rich table on a terminal, else as tab-separated lines under a header line."""
    cells = [[_cell(v) for v in row] for row in rows]
    if not sys.stdout.isatty():
        click.echo("\t".join(columns))
        for row in cells:
            click.echo("\t".join(c.replace("\t", " ").replace("\n", " ") for c in row))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        is_id = column in ("id", "task", "retry of") or column.endswith(" id")
        table.add_column(column, no_wrap=is_id, overflow="ignore" if is_id else "fold")
    for row in cells:
        table.add_row(*(escape(c) for c in row))
    Console(soft_wrap=True).print(table)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
#: The longest age taken: back from the database clock it is still a date (99999999999d was a traceback).
_MAX_AGE = timedelta(days=36_500)


class _Since(click.ParamType):  # type: ignore[type-arg]
    name = "TIME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime | timedelta:
        """An aware time, or an age (a timedelta, measured back from the database clock)."""
        if isinstance(value, datetime | timedelta):
            return value
        text = str(value).strip()
        relative = _RELATIVE.fullmatch(text)
        if relative:
            try:
                age = timedelta(**{_UNITS[relative.group(2)]: float(relative.group(1))})
            except OverflowError:
                age = _MAX_AGE * 2
            if age > _MAX_AGE:
                self.fail(
                    f"{text!r} is older than 36500d (100 years), the longest age taken; give a time instead"
                )
            return age
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            self.fail(f"{text!r}: give an age such as 30m, 2h, 1d or a time such as 2026-12-01T09:30 (UTC)")
        try:
            return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        except OverflowError:
            self.fail(f"{text!r} is not a time in UTC's years 1-9999")


def _namespace_id(conn: Any, name: str | None) -> int | None:
    if name is None:
        return None
    from orbit_server.tasks import store

    return store.get_namespace_id(conn, name)


def _namespace_filter(func: F) -> F:
    return click.option("--namespace", "namespace_name", default=None, help="Only this namespace.")(func)
