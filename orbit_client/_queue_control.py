"""Queue control calls of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient`:
change a queue's concurrency limits, pause and resume it (``admin`` key). README
"Concurrency limits and pausing a queue".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._queue_models import Queue

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import httpx

__all__: list[str] = []

_UNSET: Any = object()


def _control_body(reason: str | None, actor: str | None) -> dict[str, Any] | None:
    body = {k: v for k, v in (("reason", reason), ("actor", actor)) if v is not None}
    return body or None


def _update_body(
    max_concurrency_per_key: Any, max_concurrency: Any, reason: str | None, actor: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        name: value
        for name, value in (
            ("max_concurrency_per_key", max_concurrency_per_key),
            ("max_concurrency", max_concurrency),
        )
        if value is not _UNSET
    }
    return body | (_control_body(reason, actor) or {})


class QueueControlMixin:
    """``update_queue``, ``pause_queue`` and ``resume_queue`` of :class:`~orbit_client.OrbitClient`."""

    if TYPE_CHECKING:
        _request: Callable[..., httpx.Response]
        _path: Callable[..., str]
        _parse_model: Callable[..., Any]

    def update_queue(
        self, namespace: str, queue: str, *, max_concurrency_per_key: int | None = _UNSET,
        max_concurrency: int | None = _UNSET, reason: str | None = None, actor: str | None = None,
    ) -> Queue:  # fmt: skip
        """Change a queue's limits (``PATCH .../queues/{queue}``, ``admin`` key; retried: it sets values).

        Args:
            max_concurrency_per_key: live attempts allowed per task ``concurrency_key``; ``None``
                removes the limit; left out, unchanged.
            max_concurrency: live attempts allowed in the whole queue; as above.
            reason, actor: audited with the change (why; the person acting).

        Returns:
            The queue as it is now.

        Raises:
            NotFoundError: no such queue. UnprocessableEntityError: neither limit given, or out
                of range (1-1,000,000). OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/queues/{}", namespace, queue)
        body = _update_body(max_concurrency_per_key, max_concurrency, reason, actor)
        return self._parse_model(Queue, self._request("PATCH", path, json=body))  # type: ignore[no-any-return]

    def pause_queue(
        self, namespace: str, queue: str, *, reason: str | None = None, actor: str | None = None
    ) -> Queue:
        """Pause a queue (``admin`` key; idempotent, retried): no new leases or starts; attempts in
        flight still heartbeat, complete and fail. Returns the queue as it is now."""
        path = self._path("/v1/namespaces/{}/queues/{}/pause", namespace, queue)
        return self._parse_model(Queue, self._request("POST", path, json=_control_body(reason, actor)))  # type: ignore[no-any-return]

    def resume_queue(
        self, namespace: str, queue: str, *, reason: str | None = None, actor: str | None = None
    ) -> Queue:
        """Resume a paused queue (``admin`` key; idempotent, retried). Returns the queue as it is now."""
        path = self._path("/v1/namespaces/{}/queues/{}/resume", namespace, queue)
        return self._parse_model(Queue, self._request("POST", path, json=_control_body(reason, actor)))  # type: ignore[no-any-return]


class AsyncQueueControlMixin:
    """The async twins, for :class:`~orbit_client.AsyncOrbitClient`."""

    if TYPE_CHECKING:
        _request: Callable[..., Awaitable[httpx.Response]]
        _path: Callable[..., str]
        _parse_model: Callable[..., Any]

    async def update_queue(
        self, namespace: str, queue: str, *, max_concurrency_per_key: int | None = _UNSET,
        max_concurrency: int | None = _UNSET, reason: str | None = None, actor: str | None = None,
    ) -> Queue:  # fmt: skip
        """Async twin of :meth:`OrbitClient.update_queue`."""
        path = self._path("/v1/namespaces/{}/queues/{}", namespace, queue)
        body = _update_body(max_concurrency_per_key, max_concurrency, reason, actor)
        return self._parse_model(Queue, await self._request("PATCH", path, json=body))  # type: ignore[no-any-return]

    async def pause_queue(
        self, namespace: str, queue: str, *, reason: str | None = None, actor: str | None = None
    ) -> Queue:
        """Async twin of :meth:`OrbitClient.pause_queue`."""
        path = self._path("/v1/namespaces/{}/queues/{}/pause", namespace, queue)
        return self._parse_model(Queue, await self._request("POST", path, json=_control_body(reason, actor)))  # type: ignore[no-any-return]

    async def resume_queue(
        self, namespace: str, queue: str, *, reason: str | None = None, actor: str | None = None
    ) -> Queue:
        """Async twin of :meth:`OrbitClient.resume_queue`."""
        path = self._path("/v1/namespaces/{}/queues/{}/resume", namespace, queue)
        return self._parse_model(Queue, await self._request("POST", path, json=_control_body(reason, actor)))  # type: ignore[no-any-return]
