"""``OrbitBackend``: a ``django.tasks`` backend that hands ``@task`` functions to Orbit through the
outbox (README "Django").

::

    TASKS = {
        "default": {
            "BACKEND": "outbox_adapter.django.backend.OrbitBackend",
            "QUEUES": ["default"],
            "OPTIONS": {"NAMESPACE": "shop", "ORBIT_URL": "http://orbit:8080", "API_KEY": "..."},
        }
    }

``Task.enqueue()`` writes an outbox row through Django's connection (``OPTIONS["DATABASE"]``,
default ``"default"``) in the caller's transaction: inside ``transaction.atomic()`` it commits or
rolls back with the block. The row's handler is the function's import path, its params
``{"args": [...], "kwargs": {...}}``; the relay submits it, and ``python manage.py orbit_worker``
runs it. The ``TaskResult`` id is the row's idempotency key, stable from enqueue on.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils.module_loading import import_string

from orbit_client import OrbitClient, SubmitOptions, TaskStatus
from orbit_client import Task as OrbitTask
from outbox_adapter._enqueue import _Rendered
from outbox_adapter._exceptions import OutboxUsageError
from outbox_adapter._tables import OutboxState, OutboxTables, RowKind
from outbox_adapter.django._enqueue import enqueue as outbox_enqueue
from outbox_adapter.django._enqueue import sqlalchemy_dialect
from outbox_adapter.django._tasks_api import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_enqueued,
)

__all__ = ["OrbitBackend", "OrbitDetail", "OrbitTaskResult"]

#: The options ``OPTIONS`` may hold; any other key is refused (a typo must not pass silently).
_OPTION_KEYS = frozenset(
    {"NAMESPACE", "DATABASE", "TABLE", "ORBIT_URL", "API_KEY", "SUBMIT_OPTIONS", "TIMEOUT"}
)

#: Orbit's task states → the API's statuses. ``NEEDS_REVIEW`` (the outcome of a lost attempt is
#: unknown until a person reviews it) stays unfinished: ``RUNNING``, never ``FAILED``, since the work
#: may have been done; ``CANCELLED`` is ``FAILED`` (the API has no cancelled status).
_STATUS = {
    TaskStatus.WAITING: TaskResultStatus.READY,
    TaskStatus.LEASED: TaskResultStatus.READY,
    TaskStatus.RUNNING: TaskResultStatus.RUNNING,
    TaskStatus.NEEDS_REVIEW: TaskResultStatus.RUNNING,
    TaskStatus.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    TaskStatus.FAILED: TaskResultStatus.FAILED,
    TaskStatus.CANCELLED: TaskResultStatus.FAILED,
}


#: What ``refresh()`` reloads: the API's refreshed attributes and Orbit's detail.
_REFRESHED = (
    "errors", "_return_value", "finished_at", "started_at", "last_attempted_at", "status", "enqueued_at",
    "worker_ids", "orbit",
)  # fmt: skip


@dataclass(frozen=True)
class OrbitDetail:
    """Orbit's own view of a result, beyond the API's four statuses.

    Attributes:
        outbox_state: the outbox row's state (``PENDING``, ``DELIVERED``, ``DEAD``,
            ``NEEDS_RECONCILE``, ``ABANDONED``).
        orbit_status: the Orbit task's state (``WAITING`` ... ``NEEDS_REVIEW`` ... ``CANCELLED``);
            ``None`` while the row is unsent.
        orbit_task_id: the Orbit task's id; ``None`` while unsent.
        last_error: the relay's last error for the row (``DEAD``: why it was refused), or the
            task's error message.
        task: the Orbit task as the server reported it (``None`` while unsent).
    """

    outbox_state: str
    orbit_status: str | None = None
    orbit_task_id: str | None = None
    last_error: str | None = None
    task: OrbitTask | None = field(default=None, repr=False)


@dataclass(frozen=True, kw_only=True)
class OrbitTaskResult(TaskResult):  # type: ignore[type-arg]
    """A ``TaskResult`` with Orbit's detail (:class:`OrbitDetail`) in ``orbit``; ``refresh()``
    updates it too."""

    orbit: OrbitDetail | None = None

    def _take(self, fresh: TaskResult) -> None:  # type: ignore[type-arg]
        for attr in _REFRESHED:
            object.__setattr__(self, attr, getattr(fresh, attr, None))

    def refresh(self) -> None:
        """Reload the result (one ``get_result``), ``orbit`` included."""
        self._take(self.task.get_backend().get_result(self.id))

    async def arefresh(self) -> None:
        """Reload the result (one ``aget_result``), ``orbit`` included."""
        self._take(await self.task.get_backend().aget_result(self.id))


def _aware(value: Any) -> datetime | None:
    """A stored naive-UTC datetime (or its SQLite text) as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return None


def _exception_path(error: dict[str, Any]) -> str:
    """The import path of a failed attempt's exception class, from its traceback's last line
    (``module.Class: message``; a builtin shows its bare name) or else its type."""
    lines = [
        line for line in str(error.get("traceback") or "").splitlines() if line and not line[0].isspace()
    ]
    name = lines[-1].split(":", 1)[0].strip() if lines else str(error.get("type") or "Exception")
    return name if "." in name else f"builtins.{name}"


class OrbitBackend(BaseTaskBackend):
    """Enqueue ``django.tasks`` tasks through Orbit's outbox, in the caller's transaction.

    ``OPTIONS``:

    - ``NAMESPACE`` (required): the Orbit namespace.
    - ``DATABASE``: the ``DATABASES`` alias holding the outbox table (default ``"default"``): the
      business database, so the row commits with the models.
    - ``TABLE``: the outbox table's name (default ``orbit_outbox``).
    - ``ORBIT_URL``, ``API_KEY`` (a ``read`` key; a ``work`` key also serves ``orbit_worker``),
      ``TIMEOUT`` (seconds, default 10): how ``get_result`` asks Orbit about delivered tasks.
    - ``SUBMIT_OPTIONS``: :class:`orbit_client.SubmitOptions` fields for every task, e.g.
      ``{"retry_safe": True, "max_attempts": 5}``.

    Supported: ``queue_name`` (the Orbit queue; ``QUEUES`` lists those allowed), ``run_after``
    (Orbit's ``available_at``: the task is submitted at once and due then), ``get_result`` and
    ``aget_result`` from any process, async task functions (run by ``orbit_worker`` through
    ``async_to_sync``), ``takes_context``, ``priority`` (Orbit's task priority, the same -100..100
    with the same meaning: a lease grants the highest first, then the oldest due; README "Task
    priority"). The task's priority is the row's: ``SUBMIT_OPTIONS`` cannot set one.

    Raises at construction:
        ImproperlyConfigured: ``NAMESPACE`` missing, an unknown option key, bad ``SUBMIT_OPTIONS``
            (also one with ``priority``: set it on the task, ``@task(priority=...)``).
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    #: Every task defined for an Orbit backend (any alias), by import path: what ``orbit_worker`` runs
    #: (a task enqueued through any Orbit backend is dispatched by that path alone).
    registry: ClassVar[dict[str, Task]] = {}  # type: ignore[type-arg]

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options: dict[str, Any] = dict(self.options)
        unknown = sorted(set(options) - _OPTION_KEYS)
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown keys {unknown}; known: {sorted(_OPTION_KEYS)} "
                '(README "Django")'
            )
        namespace = options.get("NAMESPACE")
        if not isinstance(namespace, str) or not namespace:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['NAMESPACE'] must name the Orbit namespace (README \"Django\")"
            )
        self.namespace = namespace
        self.database = str(options.get("DATABASE") or DEFAULT_DB_ALIAS)
        self.tables = OutboxTables(name=options["TABLE"]) if options.get("TABLE") else OutboxTables()
        self.orbit_url: str | None = options.get("ORBIT_URL")
        self.api_key: str | None = options.get("API_KEY")
        self.timeout = float(options.get("TIMEOUT") or 10.0)
        try:
            self.submit_options = SubmitOptions.model_validate(options.get("SUBMIT_OPTIONS") or {})
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['SUBMIT_OPTIONS'] is invalid: {exc}"
            ) from None
        if self.submit_options.priority is not None:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['SUBMIT_OPTIONS'] cannot set priority: every django.tasks task has "
                'its own (@task(priority=...), Task.using(priority=...)), and it is the Orbit task\'s (README "Django")'
            )
        self._client: OrbitClient | None = None
        self._client_lock = threading.Lock()
        self._select: dict[tuple[type, str], _Rendered] = {}

    # --- enqueue ----------------------------------------------------------------------------------

    def validate_task(self, task: Task) -> None:  # type: ignore[type-arg]
        """The API's checks, and an import path that can be a handler name; registers the task for
        ``orbit_worker``.

        Raises:
            InvalidTask: a check failed (a priority outside -100..100, an unknown queue, ...).
        """
        super().validate_task(task)
        if not 1 <= len(task.module_path) <= 255:
            raise InvalidTask(
                f"the task's import path {task.module_path!r} is longer than Orbit's 255 characters"
            )
        self.registry.setdefault(task.module_path, task)

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:  # type: ignore[type-arg]
        """Write the task's outbox row in the current transaction of ``OPTIONS["DATABASE"]``.

        Returns:
            A ``READY`` result whose id is the row's idempotency key (``enqueued_at`` is ``None``
            until ``refresh()``: the database sets it when the row commits).

        Raises:
            InvalidTask: the task does not pass ``validate_task``, or its arguments are not JSON
                data Orbit stores unchanged (nothing was written).
            outbox_adapter.OutboxDatabaseError: the outbox table is missing or the insert failed.
        """
        self.validate_task(task)
        try:
            params = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
        except (TypeError, ValueError) as exc:
            raise InvalidTask(f"the task's arguments must be JSON data: {exc}") from None
        options = self.submit_options
        if task.priority:  # the API checked it is a whole number from -100 to 100; 0 is Orbit's default too
            options = options.model_copy(update={"priority": int(task.priority)})
        if task.run_after is not None:
            if task.run_after.tzinfo is None:
                raise InvalidTask("run_after must be an aware datetime")
            options = options.model_copy(update={"available_at": task.run_after})
        try:
            entry = outbox_enqueue(
                namespace=self.namespace,
                queue=task.queue_name,
                handler=task.module_path,
                params=params,
                using=self.database,
                options=options,
                tables=self.tables,
            )
        except OutboxUsageError as exc:  # params too large, a bad queue name, ...
            raise InvalidTask(str(exc)) from exc
        result = self._result(
            task, entry.idempotency_key, params, TaskResultStatus.READY, OrbitDetail("PENDING")
        )
        transaction.on_commit(lambda: task_enqueued.send(type(self), task_result=result), using=self.database)
        return result

    def _result(
        self,
        task: Task,  # type: ignore[type-arg]
        result_id: str,
        params: dict[str, Any],
        status: TaskResultStatus,
        detail: OrbitDetail,
        **times: Any,
    ) -> OrbitTaskResult:
        result = OrbitTaskResult(
            task=task,
            id=result_id,
            status=status,
            enqueued_at=times.get("enqueued_at"),
            started_at=times.get("started_at"),
            finished_at=times.get("finished_at"),
            last_attempted_at=times.get("last_attempted_at"),
            args=list(params.get("args") or []),
            kwargs=dict(params.get("kwargs") or {}),
            backend=self.alias,
            errors=list(times.get("errors") or []),
            worker_ids=list(times.get("worker_ids") or []),
            orbit=detail,
        )
        # Set whether or not the task succeeded: the API's slotted dataclass leaves it unset in a subclass.
        object.__setattr__(result, "_return_value", times.get("return_value"))
        return result

    # --- results ----------------------------------------------------------------------------------

    def client(self) -> OrbitClient:
        """The client ``get_result`` asks Orbit through (``OPTIONS["ORBIT_URL"]``, ``["API_KEY"]``).

        Raises:
            ImproperlyConfigured: either option is missing.
        """
        with self._client_lock:
            if self._client is None:
                if not self.orbit_url or not self.api_key:
                    raise ImproperlyConfigured(
                        f"TASKS[{self.alias!r}]['OPTIONS'] needs ORBIT_URL and API_KEY (a read key) to answer "
                        'get_result for a task the relay delivered (README "Django")'
                    )
                self._client = OrbitClient(self.orbit_url, api_key=self.api_key, timeout=self.timeout)
            return self._client

    def _row(self, result_id: str) -> dict[str, Any] | None:
        connection = connections[self.database]
        dialect = sqlalchemy_dialect(connection)
        key = (type(dialect), dialect.paramstyle)
        rendered = self._select.get(key)
        if rendered is None:
            o = self.tables.outbox
            stmt = sa.select(
                o.c.state, o.c.namespace, o.c.kind, o.c.handler, o.c.params, o.c.orbit_task_id, o.c.last_error,
                o.c.created_at,
            ).where(o.c.idempotency_key == sa.bindparam("b_key", type_=o.c.idempotency_key.type))  # fmt: skip
            rendered = self._select[key] = _Rendered(stmt, dialect, row=False)
        with connection.cursor() as cursor:
            cursor.execute(rendered.sql, rendered.parameters({"b_key": result_id}))
            found = cursor.fetchone()
        if found is None:
            return None
        names = (
            "state",
            "namespace",
            "kind",
            "handler",
            "params",
            "orbit_task_id",
            "last_error",
            "created_at",
        )
        row = dict(zip(names, found, strict=True))
        if isinstance(row["params"], str | bytes):
            row["params"] = json.loads(row["params"])
        return row

    def get_result(self, result_id: str) -> TaskResult:  # type: ignore[type-arg]
        """The result with id ``result_id``: from the outbox row while it is unsent, from Orbit after.

        Statuses: an unsent row (``PENDING``, ``NEEDS_RECONCILE``) is ``READY``; a row refused for
        good (``DEAD``, ``ABANDONED``) is ``FAILED`` with the relay's error. A delivered task maps
        ``WAITING``/``LEASED`` → ``READY``, ``RUNNING`` and ``NEEDS_REVIEW`` → ``RUNNING`` (unknown
        outcome, awaiting review), ``SUCCEEDED`` → ``SUCCESSFUL`` (the return value is the task's
        result), ``FAILED``/``CANCELLED`` → ``FAILED`` (one ``TaskError`` per failed attempt).
        ``result.orbit`` (:class:`OrbitDetail`) keeps Orbit's own states and ids.

        Raises:
            TaskResultDoesNotExist: no task row of this namespace has that id, or its function
                cannot be imported any more.
            ImproperlyConfigured: the row is delivered and ``ORBIT_URL``/``API_KEY`` are not set.
            orbit_client.OrbitError: Orbit could not be asked.
        """
        row = self._row(result_id)
        if row is None or row["namespace"] != self.namespace or row["kind"] != RowKind.TASK.value:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = import_string(row["handler"])
        except ImportError:
            raise TaskResultDoesNotExist(
                f"{result_id}: its task {row['handler']!r} cannot be imported"
            ) from None
        if not isinstance(task, Task):
            raise TaskResultDoesNotExist(f"{result_id}: {row['handler']!r} is not a task")
        params = row["params"] or {}
        enqueued_at = _aware(row["created_at"])
        state = row["state"]
        if state != OutboxState.DELIVERED.value:
            detail = OrbitDetail(state, last_error=row["last_error"])
            if state in (OutboxState.DEAD.value, OutboxState.ABANDONED.value):
                error = TaskError(
                    exception_class_path="outbox_adapter.OutboxError", traceback=row["last_error"] or ""
                )
                return self._result(
                    task,
                    result_id,
                    params,
                    TaskResultStatus.FAILED,
                    detail,
                    enqueued_at=enqueued_at,
                    errors=[error],
                )
            return self._result(
                task, result_id, params, TaskResultStatus.READY, detail, enqueued_at=enqueued_at
            )
        client = self.client()
        orbit_task = client.get_task(self.namespace, row["orbit_task_id"])
        attempts = client.list_attempts(self.namespace, orbit_task.id) if orbit_task.attempt_count else []
        errors = [
            TaskError(
                exception_class_path=_exception_path(a.error), traceback=str(a.error.get("traceback") or "")
            )
            for a in attempts
            if isinstance(a.error, dict)
        ]
        status = _STATUS[orbit_task.status]
        message = str(orbit_task.error.get("message")) if isinstance(orbit_task.error, dict) else None
        detail = OrbitDetail(
            state,
            orbit_status=orbit_task.status.value,
            orbit_task_id=orbit_task.id,
            last_error=message,
            task=orbit_task,
        )
        started = [a.started_at for a in attempts if a.started_at is not None]
        times: dict[str, Any] = {
            "enqueued_at": enqueued_at,
            "started_at": min(started) if started else None,
            "last_attempted_at": max(started) if started else None,
            "finished_at": orbit_task.finished_at,
            "errors": errors,
            "worker_ids": [a.worker_id for a in attempts],
        }
        if status == TaskResultStatus.SUCCESSFUL:
            times["return_value"] = orbit_task.result
        return self._result(task, result_id, params, status, detail, **times)

    def close(self) -> None:
        """Close the Orbit client (if one was made)."""
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
