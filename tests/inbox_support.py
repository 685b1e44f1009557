"""Test helpers for the result consumer: an in-memory subscription with the server's contract
(``lease_deliveries`` / ``ack_delivery``), and events to put in it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orbit_client import Delivery, OrbitConnectError, OrbitError, ResultEvent, TaskStatus

NS, SUB = "shop", "orders-results"


def result_event(
    event_id: str,
    task_id: str,
    status: TaskStatus,
    *,
    result: Any = None,
    error: Any = None,
    namespace: str = NS,
) -> ResultEvent:
    """A result event as the server sends it (``orbit_client.ResultEvent``)."""
    return ResultEvent(
        id=event_id,
        task_id=task_id,
        namespace=namespace,
        queue="fulfilment",
        handler="orders.fulfil",
        status=status,
        result=result,
        error=error,
        occurred_at=datetime(2030, 1, 1, tzinfo=UTC),
    )


@dataclass
class _Slot:
    event: ResultEvent
    count: int = 0
    leased: bool = False
    acked: bool = False


@dataclass
class FakeSubscription:
    """``lease_deliveries`` / ``ack_delivery`` as the server's contract says: an unacked delivery is
    delivered again (``delivery_count`` + 1) once its lease expired (:meth:`expire_leases`, or at
    every lease with ``instant_expiry``)."""

    instant_expiry: bool = False
    slots: dict[str, _Slot] = field(default_factory=dict)
    lease_errors: list[OrbitError] = field(default_factory=list)
    ack_errors: list[OrbitError] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    leases: int = 0
    acked_event: threading.Event = field(default_factory=threading.Event)
    leased_event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, event: ResultEvent, delivery_id: str | None = None) -> str:
        delivery_id = delivery_id or f"d-{event.id}"
        self.slots[delivery_id] = _Slot(event)
        return delivery_id

    def expire_leases(self) -> None:
        for slot in self.slots.values():
            slot.leased = False

    def lease_deliveries(
        self, namespace: str, subscription: str, *, max: int = 10, lease_seconds: float = 30.0
    ) -> list[Delivery]:
        assert (namespace, subscription) == (NS, SUB)
        with self.lock:
            out = self._lease(subscription, max)
        if out:
            self.leased_event.set()
        return out

    def _lease(self, subscription: str, max: int) -> list[Delivery]:
        self.leases += 1
        if self.lease_errors:
            raise self.lease_errors.pop(0)
        if self.instant_expiry:
            self.expire_leases()
        out = []
        for delivery_id, slot in self.slots.items():
            if len(out) == max:
                break
            if slot.acked or slot.leased:
                continue
            slot.count += 1
            slot.leased = True
            out.append(
                Delivery(
                    id=delivery_id,
                    subscription=subscription,
                    delivery_count=slot.count,
                    lease_expires_at=datetime(2030, 1, 1, tzinfo=UTC),
                    event=slot.event,
                )
            )
        return out

    def ack_delivery(self, namespace: str, subscription: str, delivery_id: str) -> None:
        with self.lock:
            if self.ack_errors:
                raise self.ack_errors.pop(0)
            self.slots[delivery_id].acked = True
            self.acks.append(delivery_id)
        self.acked_event.set()


def connect_error() -> OrbitConnectError:
    """What the client raises when Orbit refuses the connection (retryable, nothing sent)."""
    return OrbitConnectError("connection refused", method="POST", url="http://orbit/lease")
