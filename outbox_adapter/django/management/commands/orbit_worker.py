"""``python manage.py orbit_worker``: run the ``django.tasks`` tasks of an :class:`OrbitBackend` as
an Orbit worker, Django set up (README "Django")."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections
from django.utils import timezone
from django.utils.module_loading import autodiscover_modules

from orbit_client import OrbitClient, Worker
from orbit_client import TaskContext as OrbitContext
from outbox_adapter.django._tasks_api import (
    InvalidTask,
    Task,
    TaskContext,
    TaskResult,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_finished,
    task_started,
)
from outbox_adapter.django.backend import OrbitBackend

logger = logging.getLogger("outbox_adapter.django.worker")


def handler_for(task: Task, backend: OrbitBackend) -> Callable[[OrbitContext], Any]:  # type: ignore[type-arg]
    """The Orbit handler running ``task``: its params' ``args``/``kwargs`` in, its return value
    (JSON data) out; Django's connections of the slot thread are tidied before and after, as
    Django does around a request."""

    def run(ctx: OrbitContext) -> Any:
        params = ctx.params if isinstance(ctx.params, dict) else {}
        args, kwargs = list(params.get("args") or []), dict(params.get("kwargs") or {})
        close_old_connections()
        now = timezone.now()
        # The API's view of this attempt, for takes_context and the task_started/task_finished signals.
        result: TaskResult = TaskResult(  # type: ignore[type-arg]
            task=task, id=ctx.task.id, status=TaskResultStatus.RUNNING, enqueued_at=ctx.task.created_at,
            started_at=now, finished_at=None, last_attempted_at=now, args=args, kwargs=kwargs,
            backend=backend.alias, errors=[], worker_ids=[ctx.worker_id] * ctx.generation,
        )  # fmt: skip
        task_started.send(type(backend), task_result=result)
        status = TaskResultStatus.FAILED
        try:
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
            value = normalize_json(value)
            status = TaskResultStatus.SUCCESSFUL
            return value
        finally:
            object.__setattr__(result, "status", status)
            object.__setattr__(result, "finished_at", timezone.now())
            task_finished.send(type(backend), task_result=result)
            close_old_connections()

    return run


class Command(BaseCommand):
    help = (
        "Run the django.tasks tasks of an Orbit backend (TASKS[--backend]) for one queue as an Orbit worker, "
        "until SIGTERM/SIGINT. Tasks are found in every installed app's tasks module and in --import modules; "
        "each is run by its import path with leases, heartbeats, fencing and Orbit's retry rules (an exception "
        'is retried only when it is orbit_client.RetryableError or has retryable = True; README "Django").'
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue", default="default", help="The Orbit queue to lease from (default: default)."
        )
        parser.add_argument("--backend", default="default", help="The TASKS alias of the Orbit backend.")
        parser.add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="A module defining tasks besides the apps' tasks modules (repeatable).",
        )  # fmt: skip
        parser.add_argument(
            "--concurrency", type=int, default=1, help="Tasks run at once (threads; default 1)."
        )
        parser.add_argument(
            "--lease-seconds",
            type=float,
            default=30.0,
            help="Lease asked for each task, in seconds (default 30).",
        )
        parser.add_argument(
            "--orbit-url", default=None,
            help="Orbit's URL (default: $ORBIT_URL, else the backend's OPTIONS['ORBIT_URL']).",
        )  # fmt: skip
        parser.add_argument(
            "--api-key", default=None,
            help="A work key (default: $ORBIT_API_KEY, else the backend's OPTIONS['API_KEY']).",
        )  # fmt: skip
        parser.add_argument(
            "--worker-id", default=None, help="The id leases are taken under (default host:pid:random)."
        )
        parser.add_argument(
            "--metrics-port", type=int, default=None,
            help="Serve Prometheus metrics on this port (0: a free one, logged); needs the metrics extra.",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            backend = task_backends[options["backend"]]
        except InvalidTask as exc:  # pragma: no cover - the backport raises its own error type
            raise CommandError(str(exc)) from exc
        except Exception as exc:
            raise CommandError(f"--backend {options['backend']!r}: {exc}") from exc
        if not isinstance(backend, OrbitBackend):
            raise CommandError(
                f"--backend {options['backend']!r} is {type(backend).__name__}, not OrbitBackend; set its BACKEND to "
                '"outbox_adapter.django.backend.OrbitBackend" in TASKS (README "Django")'
            )
        if options["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1")
        autodiscover_modules("tasks")
        for module in options["imports"]:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise CommandError(f"--import {module!r} cannot be imported: {exc}") from exc
        tasks = OrbitBackend.registry
        if not tasks:
            raise CommandError(
                "no task uses an Orbit backend: define @task functions in an installed app's tasks.py, "
                "or name their module with --import"
            )
        url = options["orbit_url"] or os.environ.get("ORBIT_URL") or backend.orbit_url
        key = options["api_key"] or os.environ.get("ORBIT_API_KEY") or backend.api_key
        if not url or not key:
            raise CommandError(
                "Orbit's URL and a work key are needed: pass --orbit-url and --api-key, set ORBIT_URL and "
                "ORBIT_API_KEY, or OPTIONS['ORBIT_URL'] and ['API_KEY'] in TASKS"
            )
        handlers = {path: handler_for(task, backend) for path, task in sorted(tasks.items())}
        self.stdout.write(
            f"orbit_worker: namespace {backend.namespace}, queue {options['queue']}, {len(handlers)} task(s): "
            + ", ".join(handlers)
        )
        self.stdout.flush()
        with OrbitClient(url, api_key=key) as client:
            worker = Worker(
                client, backend.namespace, options["queue"], handlers, concurrency=options["concurrency"],
                lease_seconds=options["lease_seconds"], worker_id=options["worker_id"],
                metrics_port=options["metrics_port"],
            )  # fmt: skip
            worker.run()
