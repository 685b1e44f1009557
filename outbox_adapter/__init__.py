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

Everything public is re-exported here; the ``_modules`` behind it are private. The
package never imports ``orbit_server``. Its folder, by idea (imports run one way, no circles):

- ``cli/``: the ``orbit-outbox`` commands, one module per group (``_run``, ``_rows``,
  ``_repair``) over shared options and output (``_options``, ``_common``); imports the rest.
- ``_relay`` (loop, claims, shutdown) over ``_relay_send`` (sends) and ``_relay_record``
  (records); ``_consumer``, the inbox's result consumer.
- ``_enqueue`` and ``_ordering``: the application's side, in its own transaction.
- ``_manager`` (``Outbox``, the operator operations) over ``_reconcile``.
- ``_queries`` (the delivery path), ``_operator_queries``, ``_inbox_queries``: every SQL
  statement, over ``_tables``, ``_db`` and ``_migrate``.
"""

import typing as _typing

#: Top-level modules of the ``outbox`` extra's dependencies (pyproject.toml).
_OUTBOX_DEPENDENCIES = frozenset({"sqlalchemy", "alembic", "click", "pydantic_settings", "rich"})
_missing: ModuleNotFoundError | None = None

try:
    from outbox_adapter._consumer import DEFAULT_MAX_DELIVERIES, ResultConsumer
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
except ModuleNotFoundError as exc:  # a client-only install: say which extra, on first use
    if (exc.name or "").split(".")[0] not in _OUTBOX_DEPENDENCIES:
        raise
    _missing = exc

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
]


if not _typing.TYPE_CHECKING:  # for type checkers the module has exactly the names above

    def __getattr__(name: str) -> _typing.Any:
        if _missing is not None and name in __all__:
            raise ModuleNotFoundError(
                f"outbox_adapter needs the outbox extra ({_missing.name!r} is not installed); "
                "install it with: pip install 'orbit[outbox]' (add ',mysql' for MariaDB/MySQL)",
                name=_missing.name,
            ) from _missing
        raise AttributeError(f"module 'outbox_adapter' has no attribute {name!r}")


if _missing is None:
    # Errors and classes show as ``outbox_adapter.X`` in tracebacks and reprs, as in httpx.
    for _public in (
        Backoff,
        ConsumerStats,
        DeliveredRow,
        InboxOutcome,
        InboxRow,
        InvalidStateError,
        Outbox,
        OutboxDatabaseError,
        OutboxEntry,
        OutboxError,
        OutboxEvent,
        OutboxRow,
        OutboxRowError,
        OutboxSchemaError,
        OutboxState,
        OutboxStatus,
        OutboxTables,
        OutboxUsageError,
        ParamsTooLargeError,
        ReconcileDecision,
        Relay,
        RelayStats,
        ResultConsumer,
        RowKind,
        RowNotFoundError,
    ):
        _public.__module__ = "outbox_adapter"
    del _public
