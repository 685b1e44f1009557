"""The test project's ``@task`` functions (found by ``orbit_worker`` as the app's tasks module)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django_tasks import task

from orbit_client import RetryableError
from tests.django_project.shop.models import Order


@task()
def fulfil(reference: str, *, note: str = "", using: str = "default") -> dict[str, Any]:
    """Marks the order (in database ``using``) fulfilled through the ORM; returns what it did."""
    updated = Order.objects.using(using).filter(reference=reference).update(status="FULFILLED")
    return {"reference": reference, "updated": updated, "note": note}


class PaymentDeclined(Exception):
    pass


@task()
def decline(reference: str) -> None:
    raise PaymentDeclined(f"card declined for {reference}")


@task()
def flaky(marker: str) -> str:
    """Fails retryably the first time (no marker file yet), succeeds after."""
    path = Path(marker)
    if not path.exists():
        path.write_text("once")
        raise RetryableError("first attempt fails")
    return "second time lucky"


@task()
def hang(started: str) -> None:
    """Writes ``started`` then blocks: the worker process is killed while it runs."""
    Path(started).write_text(str(os.getpid()))
    time.sleep(600)


@task(takes_context=True)
def with_context(context: Any, value: int) -> dict[str, Any]:
    return {"value": value, "attempt": context.attempt, "id": context.task_result.id}


async def _double(value: int) -> int:
    return value * 2


@task()
async def double(value: int) -> int:
    return await _double(value)
