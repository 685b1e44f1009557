"""The test project's result handlers: ``apply_<alias>(event)`` completes the order a ``fulfil``
result names, through the ORM, on that database alias (``orbit_consume --handler``)."""

from __future__ import annotations

from collections.abc import Callable

from django.db.models import F

from orbit_client import ResultEvent
from tests.django_project.shop.models import Order

#: References whose next apply raises (then they are taken out): a handler failure rolls back.
FAIL_ONCE: set[str] = set()


def _apply_on(alias: str) -> Callable[[ResultEvent], None]:
    def apply(event: ResultEvent) -> None:
        result = event.result if isinstance(event.result, dict) else {}
        reference = result.get("reference")
        if not isinstance(reference, str):
            return  # not a fulfil result: nothing of ours
        orders = Order.objects.using(alias).filter(reference=reference)
        orders.update(status=event.status.value, completions=F("completions") + 1)
        if reference in FAIL_ONCE:
            FAIL_ONCE.discard(reference)
            raise RuntimeError("the handler fails once, after its update: all of it rolls back")

    return apply


apply_default = _apply_on("default")
apply_mariadb = _apply_on("mariadb")
apply_postgres = _apply_on("postgres")
