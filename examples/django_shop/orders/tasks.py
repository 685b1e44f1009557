"""``fulfil``: reserve, charge, issue a receipt; each step commits with its journal row, so an
attempt that died after a step and runs again skips it (nothing is charged twice)."""

from __future__ import annotations

import os
import sys
import threading
import uuid
from typing import Any

from django.db import transaction
from django_tasks import task

from examples.django_shop.orders.models import Charge, Order, Step

STEPS = ("reserve", "charge", "receipt")
#: Demo fault: when this file exists, the first worker to finish a charge removes it, says
#: ``paused-after-charge`` on stderr and blocks until it is killed (a worker dying mid-task).
CRASH_GATE_ENV = "DJANGO_SHOP_CRASH_AFTER_CHARGE"


def _crash_point() -> None:
    gate = os.environ.get(CRASH_GATE_ENV)
    if not gate:
        return
    try:
        os.remove(gate)
    except FileNotFoundError:
        return
    sys.stderr.write("DJANGO_SHOP paused-after-charge\n")
    sys.stderr.flush()
    threading.Event().wait()


@task(queue_name="fulfilment")
def fulfil(order_id: int) -> dict[str, Any]:
    order = Order.objects.get(pk=order_id)
    done = {step.name: step.ref for step in Step.objects.filter(order=order)}
    for name in STEPS:
        if name in done:
            continue  # finished by an earlier attempt
        ref = f"{name}-{uuid.uuid4().hex[:12]}"
        with transaction.atomic():
            if name == "charge":
                Charge.objects.create(order=order, ref=ref, amount_cents=order.amount_cents)
            Step.objects.create(order=order, name=name, ref=ref)
        done[name] = ref
        if name == "charge":
            _crash_point()
    return {"order_id": order_id, **done}
