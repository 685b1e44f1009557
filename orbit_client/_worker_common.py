"""What both pipelined workers share besides :mod:`orbit_client._pipeline`: their configuration
(with the prefetch bound and the lease-and-start switch) and the handler-error helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orbit_client._exceptions import OrbitUsageError
from orbit_client._models import LeaseGrant
from orbit_client._settings_models import ServerInfo
from orbit_client._worker import (
    _DOC_ARGS as _BASE_DOC_ARGS,
)
from orbit_client._worker import (
    _MESSAGE_MAX,
    DEFAULT_REPORT_LINGER,
    DEFAULT_THREAD_REPORT_LINGER,
    TaskContext,
    _error_for,
    _log_failure,
    _unknown_handler,
)
from orbit_client._worker import (
    _Config as _BaseConfig,
)

__all__ = [
    "DEFAULT_REPORT_LINGER",
    "DEFAULT_THREAD_REPORT_LINGER",
    "_DOC_ARGS",
    "_MESSAGE_MAX",
    "_Active",
    "_Config",
    "_error_for",
    "_log_failure",
    "_unknown_handler",
    "server_features",
]

_DOC_ARGS = _BASE_DOC_ARGS.replace(
    """        metrics_host: address the metrics server listens on. Default ``"127.0.0.1"``.
""",
    """        metrics_host: address the metrics server listens on. Default ``"127.0.0.1"``.
        prefetch: most grants held beyond ``concurrency`` (waiting for a slot); the worker holds
            fewer when its handlers are slow, so that each grant starts within a quarter of its
            lease (README "Workers"). ``None`` (the default) means four times ``concurrency``;
            ``0`` leases only for free slots.
        lease_and_start: ask for grants already ``RUNNING`` (lease-and-start: no ``start`` call;
            the attempt's first heartbeat or report confirms it, and one never confirmed lapses
            as never started) when the server offers it. Default ``True``; ``False`` confirms every
            start with its own (batched) call after the lease.
""",
)


@dataclass(eq=False)
class _Active:
    """An attempt the heartbeat loop renews: while its handler runs, and after it returned
    (``done``) until its report is answered, so that a report waiting out its linger (or retried)
    keeps its lease. A ``lease_lost`` answer for a ``done`` attempt is no loss: its report decides
    (it may have won the race with the heartbeat)."""

    grant: LeaseGrant
    ctx: TaskContext
    next_beat: float
    done: bool = False


class _Config(_BaseConfig):
    """:class:`orbit_client._worker._Config` with the pipelined workers' arguments."""

    def __init__(self, *args: Any, prefetch: int | None, lease_and_start: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if prefetch is not None and (isinstance(prefetch, bool) or not 0 <= prefetch <= 10_000):
            raise OrbitUsageError(f"prefetch must be None or 0-10000, not {prefetch!r}")
        self.prefetch_cap = 4 * self.concurrency if prefetch is None else prefetch
        self.lease_and_start = bool(lease_and_start)


def server_features(info: ServerInfo | None) -> ServerInfo | None:
    """What the server offers, from ``GET /v1/settings`` (``None``: a server without it)."""
    return info
