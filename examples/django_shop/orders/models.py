"""The shop's tables: orders, the fulfilment journal (one row per finished step), and the charges a
payment provider would hold (here in the same database, so the demo can count them)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    reference = models.CharField(max_length=64, unique=True)
    amount_cents = models.IntegerField()
    status = models.CharField(max_length=20, default="PENDING")
    #: The fulfilment task's result id (the outbox row's idempotency key).
    task_result_id = models.CharField(max_length=64, blank=True, default="")
    receipt = models.CharField(max_length=64, blank=True, default="")
    #: How many result events were applied to the order: the inbox keeps it at one.
    results_applied = models.IntegerField(default=0)

    class Meta:
        app_label = "orders"


class Step(models.Model):
    """A finished fulfilment step: a retried attempt skips it (the journal of the order service)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    name = models.CharField(max_length=20)
    ref = models.CharField(max_length=64)

    class Meta:
        app_label = "orders"
        constraints = (models.UniqueConstraint(fields=["order", "name"], name="one_step_per_order"),)


class Charge(models.Model):
    """What the payment provider charged. One per order, or the demo fails."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    ref = models.CharField(max_length=64)
    amount_cents = models.IntegerField()

    class Meta:
        app_label = "orders"
