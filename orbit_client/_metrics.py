"""Prometheus metrics of workers (README "Operations"): a worker's ``metrics_port`` option.

``prometheus-client`` is not a dependency of the client: it is imported only when a worker is
given a ``metrics_port`` (install ``orbit[metrics]``). Every worker of a process counts into one
registry, labelled by namespace and queue, so several workers may share one port; the
metrics server of a port runs while at least one worker using it runs.

No label carries a task id, attempt id, key or params: namespace, queue and (for the handler
duration) the handler name, all of them names the operator or the code chose.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from orbit_client._exceptions import OrbitUsageError
from orbit_client._task_models import TaskStatus

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["WorkerMetrics", "release_server", "serve"]

#: Handler duration buckets, in seconds.
_HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)

_lock = threading.Lock()
_families: dict[str, Any] | None = None
_registry: Any = None
#: (host, port) -> [server, thread, users]
_servers: dict[tuple[str, int], list[Any]] = {}


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise OrbitUsageError(
            "a worker's metrics_port needs prometheus-client: pip install 'orbit[metrics]'"
        ) from None
    return prometheus_client


def registry() -> CollectorRegistry:
    """The registry every worker of this process counts into (created on first use).

    Raises:
        OrbitUsageError: prometheus-client is not installed.
    """
    _families_of()
    reg: CollectorRegistry = _registry
    return reg


def _families_of() -> dict[str, Any]:
    global _families, _registry
    with _lock:
        if _families is None:
            p = _prometheus()
            r = p.CollectorRegistry()
            labels = ["namespace", "queue"]

            def counter(name: str, doc: str) -> Any:
                return p.Counter(name, doc, labels, registry=r)

            _families = {
                "leased": counter("orbit_worker_tasks_leased", "Tasks this worker leased."),
                "succeeded": counter(
                    "orbit_worker_tasks_succeeded", "Attempts reported complete (SUCCEEDED)."
                ),
                "failed": counter(
                    "orbit_worker_tasks_failed", "Attempts reported failed that ended their task FAILED."
                ),
                "retried": counter(
                    "orbit_worker_tasks_retried", "Attempts reported failed whose task the server will retry."
                ),
                "cancelled": counter(
                    "orbit_worker_tasks_cancelled",
                    "Attempts that stopped for a cancellation (task CANCELLED).",
                ),
                "lease_lost": counter(
                    "orbit_worker_lease_lost",
                    "Attempts whose lease was lost (a heartbeat or report answered lease_lost).",
                ),
                "heartbeat_failures": counter(
                    "orbit_worker_heartbeat_failures",
                    "Heartbeats that failed (other than lease_lost); retried.",
                ),
                "handler_seconds": p.Histogram(
                    "orbit_worker_handler_duration_seconds",
                    "Time a handler ran, in seconds, whatever its outcome.",
                    [*labels, "handler"],
                    buckets=_HANDLER_BUCKETS,
                    registry=r,
                ),
            }
            _registry = r
        return _families


class WorkerMetrics:
    """One worker's counters (children of the process-wide families, labels bound once).

    Raises:
        OrbitUsageError: prometheus-client is not installed.
    """

    def __init__(self, namespace: str, queue: str) -> None:
        families = _families_of()
        self._labels = (namespace, queue)
        self._handler_seconds = families["handler_seconds"]
        self._handler_children: dict[str, Any] = {}
        self._leased = families["leased"].labels(namespace, queue)
        self._lease_lost = families["lease_lost"].labels(namespace, queue)
        self._heartbeat_failures = families["heartbeat_failures"].labels(namespace, queue)
        succeeded = families["succeeded"].labels(namespace, queue)
        failed = families["failed"].labels(namespace, queue)
        self._by_status = {
            TaskStatus.SUCCEEDED: succeeded,
            TaskStatus.FAILED: failed,
            TaskStatus.NEEDS_REVIEW: failed,
            TaskStatus.WAITING: families["retried"].labels(namespace, queue),
            TaskStatus.CANCELLED: families["cancelled"].labels(namespace, queue),
        }

    def leased(self, tasks: int) -> None:
        if tasks:
            self._leased.inc(tasks)

    def reported(self, task_status: TaskStatus) -> None:
        """A complete or fail report was answered; the task's status after it says what it became."""
        counter = self._by_status.get(task_status)
        if counter is not None:
            counter.inc()

    def lease_lost(self) -> None:
        self._lease_lost.inc()

    def heartbeat_failed(self) -> None:
        self._heartbeat_failures.inc()

    def handler_ran(self, handler: str, seconds: float) -> None:
        child = self._handler_children.get(handler)
        if child is None:
            child = self._handler_children[handler] = self._handler_seconds.labels(*self._labels, handler)
        child.observe(seconds)


def serve(host: str, port: int) -> int:
    """Serve the workers' registry at ``http://host:port/metrics`` (shared per port); the port bound.

    Raises:
        OrbitUsageError: prometheus-client is not installed, or the port cannot be bound.
    """
    reg = registry()
    p = _prometheus()
    with _lock:
        entry = _servers.get((host, port))
        if entry is None:
            try:
                server, thread = p.start_http_server(port, addr=host, registry=reg)
            except OSError as exc:
                raise OrbitUsageError(
                    f"cannot serve worker metrics on {host}:{port} ({exc.strerror or exc}); choose another "
                    "metrics_port"
                ) from None
            entry = _servers[(host, port)] = [server, thread, 0]
            if port == 0:  # a free port: remember it under the port bound too, for release_server
                _servers[(host, server.server_port)] = entry
        entry[2] += 1
        bound: int = entry[0].server_port
        return bound


def release_server(host: str, port: int) -> None:
    """One user of the metrics server at ``host:port`` is done; the last one stops it."""
    with _lock:
        entry = _servers.get((host, port))
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] > 0:
            return
        for key in [key for key, value in _servers.items() if value is entry]:
            del _servers[key]
    server, thread, _ = entry
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
