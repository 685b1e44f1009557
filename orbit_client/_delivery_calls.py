"""Result-event calls of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient`:
create and fetch subscriptions, lease and acknowledge their deliveries (DESIGN §4 "Result events",
§6.2 of the reliability model; README "Consuming results (inbox)", "Result events").

Each call is one function that builds its :class:`~orbit_client._calls._Call` (no I/O); the two
mixins send it.
"""

from __future__ import annotations

from collections.abc import Sequence

from orbit_client._calls import _body, _Call, _many, _nothing, _one, _path, _Sends, _SendsAsync
from orbit_client._delivery_models import Delivery, DeliveryLeaseRequest, Subscription, SubscriptionRequest
from orbit_client._exceptions import OrbitUsageError

__all__: list[str] = []


def _create_subscription(namespace: str, name: str, queues: Sequence[str] | None) -> _Call[Subscription]:
    """``POST /v1/namespaces/{ns}/subscriptions``: idempotent (same queues), so retried."""
    if isinstance(queues, str):
        raise OrbitUsageError("queues is a list of queue names, not one string; nothing was sent")
    path = _path("/v1/namespaces/{}/subscriptions", namespace)
    body = _body(
        SubscriptionRequest, "subscription", name=name, queues=list(queues) if queues is not None else None
    )
    return _Call("POST", path, _one(Subscription), json=body)


def _get_subscription(namespace: str, name: str) -> _Call[Subscription]:
    return _Call("GET", _path("/v1/namespaces/{}/subscriptions/{}", namespace, name), _one(Subscription))


def _lease_deliveries(
    namespace: str, subscription: str, max: int, lease_seconds: float
) -> _Call[list[Delivery]]:
    """``POST .../subscriptions/{name}/deliveries/lease``: not retried (a lost answer only leases)."""
    path = _path("/v1/namespaces/{}/subscriptions/{}/deliveries/lease", namespace, subscription)
    body = _body(DeliveryLeaseRequest, "delivery lease request", max=max, lease_seconds=lease_seconds)
    return _Call("POST", path, _many(Delivery), json=body, retry=False)


def _ack_delivery(namespace: str, subscription: str, delivery_id: str) -> _Call[None]:
    """``POST .../deliveries/{id}/ack``: idempotent, so retried."""
    path = _path("/v1/namespaces/{}/subscriptions/{}/deliveries/{}/ack", namespace, subscription, delivery_id)
    return _Call("POST", path, _nothing)


class DeliveryCallsMixin(_Sends):
    """The result-event calls of :class:`~orbit_client.OrbitClient`."""

    def create_subscription(
        self, namespace: str, name: str, *, queues: Sequence[str] | None = None
    ) -> Subscription:
        """Create a subscription to the namespace's result events (``admin`` key). Idempotent.

        ``POST /v1/namespaces/{ns}/subscriptions``. It receives the result events (tasks that
        reached ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``NEEDS_REVIEW``) that occur from
        its creation on, never earlier ones. Creating it again with the same queues returns the
        existing subscription, so the call is retried.

        Args:
            name: the subscription's name, unique in the namespace (pattern of queue names).
            queues: the queue names whose events it receives (order ignored); ``None`` means
                every queue of the namespace, including queues created later.

        Returns:
            The subscription (new, or the existing one with the same queues).

        Raises:
            OrbitUsageError: an invalid name or queue name; nothing was sent.
            ConflictError: ``subscription_exists``: the name is taken with other queues.
            NotFoundError: ``queue_not_found``: a named queue does not exist.
            OrbitError: as for every call.
        """
        return self._send(_create_subscription(namespace, name, queues))

    def get_subscription(self, namespace: str, name: str) -> Subscription:
        """Fetch a subscription (``GET /v1/namespaces/{ns}/subscriptions/{name}``).

        Raises:
            NotFoundError: ``subscription_not_found``, or another namespace.
            OrbitError: as for every call.
        """
        return self._send(_get_subscription(namespace, name))

    def lease_deliveries(
        self, namespace: str, subscription: str, *, max: int = 10, lease_seconds: float = 30.0
    ) -> list[Delivery]:
        """Lease up to ``max`` unacked deliveries of a subscription (``work`` or ``admin`` key).

        ``POST .../subscriptions/{name}/deliveries/lease``. Oldest first; concurrent callers
        never get the same delivery while its lease runs. Process each event, commit its effect
        (deduping by ``delivery.event.id``: delivery is at least once), then
        :meth:`ack_delivery`. A delivery not acked within ``lease_seconds`` is handed out again
        with a higher ``delivery_count``.

        Not retried by the client: an answer lost on the way only leaves its deliveries leased
        until ``lease_seconds`` pass; then they are handed out again, so nothing is lost and
        the caller may simply lease again.

        Args:
            max: most deliveries, 1-500. Default 10.
            lease_seconds: lease duration in seconds (0.1-3600), judged by the server's
                database clock. Default 30.

        Returns:
            The deliveries; empty when none is due (the call does not wait).

        Raises:
            OrbitUsageError: an argument is out of range; nothing was sent.
            NotFoundError: ``subscription_not_found``, or another namespace.
            OrbitError: as for every call.
        """
        return self._send(_lease_deliveries(namespace, subscription, max, lease_seconds))

    def ack_delivery(self, namespace: str, subscription: str, delivery_id: str) -> None:
        """Acknowledge a delivery once its event's effect is committed (``work`` or ``admin`` key).

        ``POST .../subscriptions/{name}/deliveries/{id}/ack``. The delivery is never handed out
        again. Idempotent (acking twice answers 200), so it is retried. If the ack is lost after
        all, the event is delivered again after its lease and the receiver's dedupe by event id
        absorbs it.

        Raises:
            NotFoundError: ``delivery_not_found`` (not a delivery of this subscription), or
                ``subscription_not_found``.
            OrbitError: as for every call.
        """
        return self._send(_ack_delivery(namespace, subscription, delivery_id))


class AsyncDeliveryCallsMixin(_SendsAsync):
    """The result-event calls of :class:`~orbit_client.AsyncOrbitClient` (async twins)."""

    async def create_subscription(
        self, namespace: str, name: str, *, queues: Sequence[str] | None = None
    ) -> Subscription:
        """Async twin of :meth:`OrbitClient.create_subscription`."""
        return await self._send(_create_subscription(namespace, name, queues))

    async def get_subscription(self, namespace: str, name: str) -> Subscription:
        """Async twin of :meth:`OrbitClient.get_subscription`."""
        return await self._send(_get_subscription(namespace, name))

    async def lease_deliveries(
        self, namespace: str, subscription: str, *, max: int = 10, lease_seconds: float = 30.0
    ) -> list[Delivery]:
        """Async twin of :meth:`OrbitClient.lease_deliveries` (not retried either)."""
        return await self._send(_lease_deliveries(namespace, subscription, max, lease_seconds))

    async def ack_delivery(self, namespace: str, subscription: str, delivery_id: str) -> None:
        """Async twin of :meth:`OrbitClient.ack_delivery` (idempotent, retried)."""
        return await self._send(_ack_delivery(namespace, subscription, delivery_id))
