"""Fake inventory, payment, receipt and messaging providers that behave like careful real ones.

Each call carries an idempotency key (one per order and step) and the attempt's fencing
token: the task id and its ``generation``. A provider:

- performs the side effect once per key; a repeated key gets the first result back
  (``replayed``), as Stripe-style APIs do;
- refuses a call whose generation is lower than the newest it has seen for the order and
  task, at any provider (``stale``): a worker that lost its lease cannot act after a newer
  attempt, even at a provider the newer attempt has not reached yet (generation 2 reserved,
  then generation 1 tries to charge: refused). Generations count per task (a flow's steps are
  tasks of their own), so the fence is the task's, not the order's alone;
- records every call in ``provider_calls`` and every effect in ``provider_effects``,
  so the demo can count side effects.

The payment provider declines orders above :data:`CARD_LIMIT` (a permanent failure).
"""

from __future__ import annotations

import uuid
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .db import provider_calls, provider_effects

__all__ = ["CARD_LIMIT", "PaymentDeclined", "Providers", "StaleGeneration"]

#: Orders above this amount are declined by the fake payment provider.
CARD_LIMIT = Decimal("500.00")


class PaymentDeclined(Exception):
    """The payment provider refused the charge for good."""


class StaleGeneration(Exception):
    """A newer attempt already called this provider for the order (fencing)."""


class Providers:
    """The three providers, recording into the business database behind ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def reserve(self, order_id: str, sku: str, quantity: int, *, task_id: str, generation: int) -> str:
        """Reserve ``quantity`` of ``sku``; returns the reservation id."""
        return self._call("reserve", order_id, task_id, generation, prefix="res")

    def charge(self, order_id: str, amount: Decimal, *, task_id: str, generation: int) -> str:
        """Charge ``amount``; returns the payment id. Raises PaymentDeclined above the card limit."""
        if amount > CARD_LIMIT:
            self._log("charge", order_id, f"{order_id}:charge", task_id, generation, "declined")
            raise PaymentDeclined(f"card limit exceeded: {amount} > {CARD_LIMIT}")
        return self._call("charge", order_id, task_id, generation, prefix="pay")

    def issue_receipt(self, order_id: str, payment_id: str, *, task_id: str, generation: int) -> str:
        """Issue the receipt for a payment; returns the receipt id."""
        return self._call("receipt", order_id, task_id, generation, prefix="rct")

    def release(self, order_id: str, *, task_id: str, generation: int) -> str:
        """Give back the stock an order reserved (a cancelled or unpaid order); returns the release id."""
        return self._call("release", order_id, task_id, generation, prefix="rel")

    def notify(self, order_id: str, kind: str, *, task_id: str, generation: int) -> str:
        """Send the customer a message of ``kind`` (``order_confirmation`` → provider ``notify``,
        ``payment_reminder`` → provider ``remind``); returns the message id."""
        provider = "remind" if kind == "payment_reminder" else "notify"
        return self._call(provider, order_id, task_id, generation, prefix="msg")

    def _log(
        self, provider: str, order_id: str, key: str, task_id: str, generation: int, outcome: str
    ) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                provider_calls.insert().values(
                    provider=provider,
                    order_id=order_id,
                    idempotency_key=key,
                    task_id=task_id,
                    generation=generation,
                    outcome=outcome,
                )
            )

    def _call(self, provider: str, order_id: str, task_id: str, generation: int, *, prefix: str) -> str:
        try:
            return self._call_once(provider, order_id, task_id, generation, prefix=prefix)
        except sa.exc.IntegrityError:  # a concurrent call with the same key performed it first
            return self._call_once(provider, order_id, task_id, generation, prefix=prefix)

    def _call_once(self, provider: str, order_id: str, task_id: str, generation: int, *, prefix: str) -> str:
        key = f"{order_id}:{provider}"
        with self._engine.begin() as conn:
            highest = conn.scalar(  # the newest attempt of this task seen at any provider for the order
                sa.select(sa.func.max(provider_calls.c.generation)).where(
                    provider_calls.c.order_id == order_id,
                    provider_calls.c.task_id == task_id,
                    provider_calls.c.outcome != "stale",
                )
            )
            if highest is not None and generation < highest:
                outcome, result_id = "stale", None
            else:
                result_id = conn.scalar(
                    sa.select(provider_effects.c.result_id).where(provider_effects.c.idempotency_key == key)
                )
                outcome = "replayed" if result_id else "performed"
                if result_id is None:
                    result_id = f"{prefix}_{uuid.uuid4().hex[:16]}"
                    conn.execute(
                        provider_effects.insert().values(
                            provider=provider, order_id=order_id, idempotency_key=key, result_id=result_id,
                            generation=generation,
                        )
                    )  # fmt: skip
            conn.execute(
                provider_calls.insert().values(
                    provider=provider,
                    order_id=order_id,
                    idempotency_key=key,
                    task_id=task_id,
                    generation=generation,
                    outcome=outcome,
                )
            )
        if result_id is None:
            raise StaleGeneration(f"{provider} for {order_id}: generation {generation} < {highest}")
        return result_id
