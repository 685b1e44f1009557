"""Transactional outbox for Orbit: write the intent to submit a task in the business transaction,
and let a relay deliver it exactly once per key (README "Outbox").

::

    with engine.begin() as conn:                      # the application's transaction
        conn.execute(orders.insert().values(...))
        enqueue(conn, namespace="shop", queue="default", handler="orders.fulfil", params={"order_id": 42})

    # elsewhere, any number of processes:  orbit-outbox relay --database-url ... --orbit-url ... --api-key ...

Results come back the other way through the inbox: :class:`ResultConsumer` applies each
result event of a subscription once, in the transaction that records it in ``orbit_inbox``
(``orbit-outbox consume --subscription NAME --handler module:function``).

Everything public is re-exported here; the ``_modules`` behind it are private. A name is imported
from its module on first use (PEP 562), so ``import outbox_adapter`` and ``orbit-outbox --help``
import neither SQLAlchemy nor the client. The package never imports ``orbit_server``. Its folder, by idea (imports run one way, no circles):

- ``cli/``: the ``orbit-outbox`` commands, one module per group (``_run``, ``_rows``,
  ``_repair``) over shared options and output (``_options``, ``_common``); imports the rest.
- ``_relay`` (loop, claims, shutdown) over ``_relay_send`` (sends) and ``_relay_record``
  (records); ``_consumer``, the inbox's result consumer.
- ``_enqueue`` and ``_ordering``: the application's side, in its own transaction.
- ``_manager`` (``Outbox``, the operator operations) over ``_reconcile``.
- ``_queries`` (the delivery path), ``_operator_queries``, ``_inbox_queries``: every SQL
  statement, over ``_tables``, ``_db`` and ``_migrate``.
"""

import importlib as _importlib
import sys as _sys
import typing as _typing

#: Top-level modules of the ``outbox`` extra's dependencies (pyproject.toml).
_OUTBOX_DEPENDENCIES = frozenset({"sqlalchemy", "alembic", "click", "pydantic_settings", "rich"})

if _typing.TYPE_CHECKING:  # what the type checkers see; at run time ``__getattr__`` imports each on first use
    from outbox_adapter._consumer import DEFAULT_MAX_DELIVERIES, ResultConsumer
    from outbox_adapter._db import is_transient_db_error
    from outbox_adapter._enqueue import (
        DEFAULT_MAX_PARAMS_BYTES,
        enqueue,
        enqueue_async,
        enqueue_flow,
        enqueue_flow_async,
    )
    from outbox_adapter._exceptions import (
        InvalidStateError,
        OutboxDatabaseError,
        OutboxError,
        OutboxRowError,
        OutboxSchemaError,
        OutboxUsageError,
        ParamsTooLargeError,
        RowNotFoundError,
    )
    from outbox_adapter._manager import DEFAULT_KEY_WINDOW_SECONDS, Outbox
    from outbox_adapter._metrics import ConsumerMetrics, RelayMetrics
    from outbox_adapter._migrate import head_revision
    from outbox_adapter._models import (
        ConsumerStats,
        DeliveredRow,
        InboxRow,
        OutboxEntry,
        OutboxEvent,
        OutboxRow,
        OutboxStatus,
        ReconcileDecision,
        RelayStats,
    )
    from outbox_adapter._outcomes import Backoff
    from outbox_adapter._relay import DEFAULT_MAX_ATTEMPTS, Relay
    from outbox_adapter._settings import OutboxSettings
    from outbox_adapter._tables import DEFAULT_TABLE_NAME, InboxOutcome, OutboxState, OutboxTables, RowKind

__all__ = [
    "DEFAULT_KEY_WINDOW_SECONDS",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_MAX_PARAMS_BYTES",
    "DEFAULT_TABLE_NAME",
    "Backoff",
    "ConsumerMetrics",
    "ConsumerStats",
    "DeliveredRow",
    "InboxOutcome",
    "InboxRow",
    "InvalidStateError",
    "Outbox",
    "OutboxDatabaseError",
    "OutboxEntry",
    "OutboxError",
    "OutboxEvent",
    "OutboxRow",
    "OutboxRowError",
    "OutboxSchemaError",
    "OutboxSettings",
    "OutboxState",
    "OutboxStatus",
    "OutboxTables",
    "OutboxUsageError",
    "ParamsTooLargeError",
    "ReconcileDecision",
    "Relay",
    "RelayMetrics",
    "RelayStats",
    "ResultConsumer",
    "RowKind",
    "RowNotFoundError",
    "enqueue",
    "enqueue_async",
    "enqueue_flow",
    "enqueue_flow_async",
    "head_revision",
    "is_transient_db_error",
]

#: The private module that defines each public name (the imports above, for the interpreter).
_HOMES = {
    name: module
    for module, names in {
        "_consumer": ("DEFAULT_MAX_DELIVERIES", "ResultConsumer"),
        "_db": ("is_transient_db_error",),
        "_enqueue": ("DEFAULT_MAX_PARAMS_BYTES", "enqueue", "enqueue_async", "enqueue_flow", "enqueue_flow_async"),
        "_exceptions": (
            "InvalidStateError", "OutboxDatabaseError", "OutboxError", "OutboxRowError", "OutboxSchemaError",
            "OutboxUsageError", "ParamsTooLargeError", "RowNotFoundError",
        ),
        "_manager": ("DEFAULT_KEY_WINDOW_SECONDS", "Outbox"),
        "_metrics": ("ConsumerMetrics", "RelayMetrics"),
        "_migrate": ("head_revision",),
        "_models": (
            "ConsumerStats", "DeliveredRow", "InboxRow", "OutboxEntry", "OutboxEvent", "OutboxRow", "OutboxStatus",
            "ReconcileDecision", "RelayStats",
        ),
        "_outcomes": ("Backoff",),
        "_relay": ("DEFAULT_MAX_ATTEMPTS", "Relay"),
        "_settings": ("OutboxSettings",),
        "_tables": ("DEFAULT_TABLE_NAME", "InboxOutcome", "OutboxState", "OutboxTables", "RowKind"),
    }.items()
    for name in names
}  # fmt: skip

#: Errors and classes show as ``outbox_adapter.X`` in tracebacks and reprs, as in httpx.
_SHOWN_AS_PACKAGE = (
    "Backoff", "ConsumerStats", "DeliveredRow", "InboxOutcome", "InboxRow", "InvalidStateError", "Outbox",
    "OutboxDatabaseError", "OutboxEntry", "OutboxError", "OutboxEvent", "OutboxRow", "OutboxRowError",
    "OutboxSchemaError", "OutboxState", "OutboxStatus", "OutboxTables", "OutboxUsageError", "ParamsTooLargeError",
    "ReconcileDecision", "Relay", "RelayStats", "ResultConsumer", "RowKind", "RowNotFoundError",
)  # fmt: skip


def _load(name: str) -> _typing.Any:
    """The public ``name``, imported from its module (and kept here: the next lookup is a plain one).

    Raises:
        AttributeError: not a public name.
        ModuleNotFoundError: an outbox dependency is missing (a client-only install); the message says which
            extra to install.
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'outbox_adapter' has no attribute {name!r}")
    try:
        module = _importlib.import_module(f"outbox_adapter.{home}")
    except ModuleNotFoundError as exc:  # a client-only install: say which extra
        if (exc.name or "").split(".")[0] not in _OUTBOX_DEPENDENCIES:
            raise
        raise ModuleNotFoundError(
            f"outbox_adapter needs the outbox extra ({exc.name!r} is not installed); "
            "install it with: pip install 'orbit-tasks[outbox]' (add ',mysql' for MariaDB/MySQL)",
            name=exc.name,
        ) from exc
    # Every public class of the modules loaded so far (this one and what it imported) shows the package.
    for public in _SHOWN_AS_PACKAGE:
        defined_in = _sys.modules.get(f"outbox_adapter.{_HOMES[public]}")
        cls = getattr(defined_in, public, None)
        if cls is not None:
            cls.__module__ = "outbox_adapter"
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if not _typing.TYPE_CHECKING:  # for type checkers the module has exactly the names above, no ``__getattr__``
    __getattr__ = _load
