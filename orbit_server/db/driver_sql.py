"""Hot statements compiled once per dialect into the driver's SQL and run with ``exec_driver_sql``.

Why: ``Connection.execute`` of a compiled statement costs SQLAlchemy, on every call, a look-up in its
compiled-statement cache (the statement's cache key), an execution context that builds the parameters
from the compiled statement, and a result set up for the compiled columns: about 35 µs of CPU per
statement here against 75 µs for the driver's own work (an ``INSERT`` of a task event, MariaDB with
PyMySQL). A worker call runs three to five such statements, so the server paid that several times per
call (issue 28, ``python -m bench.call_floor``).

:class:`DriverSQL` keeps a statement built once at import (a ``text()`` or Core statement whose
parameters are all bind parameters), compiles it the first time each dialect runs it, and runs it as
``exec_driver_sql(<compiled SQL>, <parameters>)``: each value converted by the bind processor SQLAlchemy
itself would apply (the column type's: ``JSON`` to its text, for example), in the driver's parameter
style. The rows come back as the driver gives them, without SQLAlchemy's result processors: use it for
statements whose result columns the driver already gives as the caller wants them (counts, strings,
integers, packed rows: :mod:`~orbit_server.db.packed_rows`), or for no result at all. Engine events
(``before_cursor_execute`` and the rest) fire as for any statement.

Statements with ``expanding`` (``IN``-list) or ``literal_execute`` parameters whose values each call gives
are refused when compiled: their SQL changes with the values. Those given their values when the statement
was built (``column.in_(["A", "B"])``) are rendered once, as one bind parameter per value.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult

__all__ = ["DriverSQL", "insert_of"]


class _Compiled:
    """One dialect's form of a :class:`DriverSQL`: its SQL, and how a call's parameters become the driver's."""

    __slots__ = ("defaults", "names", "positional", "processors", "sql", "steps")

    def __init__(self, statement: sa.Executable, dialect: sa.Dialect) -> None:
        compiled: Any = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
        if any(bind.required for bind in compiled.post_compile_params | compiled.literal_execute_params):
            raise TypeError("DriverSQL cannot run a statement with expanding or literal_execute parameters")
        if compiled.escaped_bind_names:
            raise TypeError("DriverSQL cannot run a statement whose bind names the driver escapes")
        required = {name for bind, name in compiled.bind_names.items() if bind.required}
        # IN lists of values given when the statement was built rendered once, one bind parameter per value
        expanded = compiled.construct_expanded_state(dict.fromkeys(required))
        self.sql: str = expanded.statement
        self.positional: bool = bool(compiled.positional)
        #: the bind names in the driver's order (positional) or as the driver names them (named)
        self.names: tuple[str, ...] = tuple(expanded.positiontup if self.positional else expanded.parameters)
        self.processors: dict[str, Callable[[Any], Any]] = {
            **compiled._bind_processors,
            **expanded.processors,
        }
        #: values of bind parameters given a value when the statement was built (not required per call)
        self.defaults: dict[str, Any] = {
            name: value for name, value in expanded.parameters.items() if name not in required
        }
        #: each bind name in order with its bind processor (``None``: the value as it is)
        self.steps: tuple[tuple[str, Callable[[Any], Any] | None], ...] = tuple(
            (name, self.processors.get(name)) for name in self.names
        )

    def parameters(self, params: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        """``params`` (by bind name) as the driver takes them, each converted by its bind processor (``None``
        too, as ``Connection.execute`` converts it: a JSON type without ``none_as_null`` writes JSON ``null``).

        Raises:
            KeyError: a bind parameter without a value.
        """
        if self.defaults:
            params = {**self.defaults, **params}
        try:
            values = [
                params[name] if convert is None else convert(params[name]) for name, convert in self.steps
            ]
        except KeyError as exc:
            raise KeyError(f"no value for bind parameter {exc.args[0]!r} of {self.sql[:60]!r}...") from None
        return tuple(values) if self.positional else dict(zip(self.names, values, strict=True))


class DriverSQL:
    """A statement built once, run through ``exec_driver_sql`` in each dialect's compiled form (module
    docstring). ``execute(conn, params)`` answers the ``CursorResult`` with the driver's own values."""

    __slots__ = ("_by_dialect", "statement")
    #: :meth:`of`'s forms (by dialect), by statement (forgotten with it: nothing in them refers to it).
    _OF: ClassVar[
        weakref.WeakKeyDictionary[sa.Executable, weakref.WeakKeyDictionary[sa.Dialect, _Compiled]]
    ] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, statement: sa.Executable) -> DriverSQL:
        """The :class:`DriverSQL` of ``statement``, made on its first use: for statements built (and cached)
        elsewhere, by size or by dialect."""
        forms = cls._OF.get(statement)
        if forms is None:  # not the DriverSQL itself: a value of _OF that held its key would keep it for ever
            forms = cls._OF[statement] = weakref.WeakKeyDictionary()
        return cls(statement, forms)

    def __init__(
        self, statement: sa.Executable, forms: weakref.WeakKeyDictionary[sa.Dialect, _Compiled] | None = None
    ) -> None:
        self.statement = statement
        self._by_dialect: weakref.WeakKeyDictionary[sa.Dialect, _Compiled] = (
            weakref.WeakKeyDictionary() if forms is None else forms
        )

    def compiled(self, dialect: sa.Dialect) -> _Compiled:
        """The statement's form for ``dialect``, compiled on its first use (one dialect object per engine;
        forgotten with it)."""
        form = self._by_dialect.get(dialect)
        if form is None:
            form = self._by_dialect[dialect] = _Compiled(self.statement, dialect)
        return form

    def execute(
        self, conn: Connection, params: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> CursorResult[Any]:
        """Run the statement on ``conn`` with ``params`` (by bind name; a parameter given a value when the
        statement was built may be left out); a list of them runs it once for each (the driver's
        ``executemany``: PyMySQL sends an ``INSERT``'s rows as one multi-row statement).

        Raises:
            KeyError: a bind parameter without a value.
            sqlalchemy.exc.DBAPIError: as ``Connection.execute`` raises it.
        """
        if not isinstance(params, Mapping) and len(params) > 1 and _many_values(conn.dialect, self.statement):
            # SQLAlchemy's multi-row INSERTs ("insertmanyvalues", PostgreSQL: db/engine.py), not the driver's
            # executemany (psycopg: one INSERT per row)
            return conn.execute(self.statement, list(params))
        form = self.compiled(conn.dialect)
        if isinstance(params, Mapping):
            return conn.exec_driver_sql(form.sql, form.parameters(params))
        return conn.exec_driver_sql(form.sql, [form.parameters(row) for row in params])


def _many_values(dialect: sa.Dialect, statement: sa.Executable) -> bool:
    """Whether ``Connection.execute`` sends many rows of ``statement`` as multi-row ``INSERT`` statements."""
    return (
        isinstance(statement, sa.Insert)
        and bool(getattr(dialect, "use_insertmanyvalues", False))
        and bool(getattr(dialect, "use_insertmanyvalues_wo_returning", False))
    )


def insert_of(table: sa.Table, columns: Sequence[str]) -> DriverSQL:
    """``INSERT INTO <table> (<columns>) VALUES (:<column>, ...)``, each parameter typed as its column: the
    rows of one caller, which always gives these columns (``table.insert()`` takes its columns from each
    call's parameters instead). ``inline``: no ``RETURNING`` of an autoincremented key, which nothing reads
    (PostgreSQL's form of a Core ``INSERT`` has one otherwise)."""
    return DriverSQL(
        table.insert()
        .inline()
        .values({name: sa.bindparam(name, type_=table.c[name].type) for name in columns})
    )
