"""Fencing in the reference service: a worker that lost its lease cannot act after a newer attempt.

Regression (issue 20 #3): the providers fenced per order *and provider* and the step journal took an
entry from any generation, so generation 1 (stopped past its lease) resumed after generation 2 had
reserved, charged and issued the receipt with generation 1 and journaled both; generation 2 then
skipped them as done. The interleaving is driven in process: generation 1 is "stopped" right after
its reserve call, generation 2 runs meanwhile up to the charge, then generation 1 resumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from examples.order_service.db import (
    create_business_tables,
    journal_entries,
    provider_calls,
    provider_effects,
)
from examples.order_service.providers import Providers, StaleGeneration
from examples.order_service.worker import make_handler
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS

PARAMS_AMOUNT = Decimal("10.00")
PARAMS = {"order_id": "ord_1", "sku": "SKU-1", "quantity": 1, "amount": "10.00"}


class _Stopped(Exception):
    """Generation 2 'stops' here (its lease would run out next; it is not resumed in this test)."""


def _ctx(generation: int, task_id: str = "t1") -> Any:
    return SimpleNamespace(
        task=SimpleNamespace(id=task_id),
        generation=generation,
        params=PARAMS,
        raise_if_cancelled=lambda: None,
    )


@pytest.fixture(params=BACKENDS)
def shop(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[sa.Engine]:
    engine = sa.create_engine(make_database(request.param))
    create_business_tables(engine)
    yield engine
    engine.dispose()


def test_a_resumed_stale_attempt_cannot_act_after_a_newer_one(
    shop: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_reserve, real_charge = Providers.reserve, Providers.charge

    def reserve(self: Providers, *args: Any, generation: int, **kw: Any) -> str:
        result = real_reserve(self, *args, generation=generation, **kw)
        if generation == 1:  # generation 1 stops here, past its lease; generation 2 runs meanwhile
            with pytest.raises(_Stopped):
                make_handler(shop)(_ctx(2))
        return result

    def charge(self: Providers, *args: Any, generation: int, **kw: Any) -> str:
        if generation == 2:
            raise _Stopped
        return real_charge(self, *args, generation=generation, **kw)

    monkeypatch.setattr(Providers, "reserve", reserve)
    monkeypatch.setattr(Providers, "charge", charge)
    with pytest.raises(StaleGeneration):  # generation 1 resumes: refused, before any charge
        make_handler(shop)(_ctx(1))
    with shop.connect() as conn:
        effects = conn.execute(sa.select(provider_effects.c.provider)).scalars().all()
        journal = conn.execute(sa.select(journal_entries.c.step_name, journal_entries.c.generation)).all()
        acted = conn.execute(
            sa.select(provider_calls.c.provider, provider_calls.c.generation).where(
                provider_calls.c.outcome.in_(["performed", "replayed"])
            )
        ).all()
    assert effects == ["reserve"]  # no charge, no receipt by the stale attempt
    assert [tuple(r) for r in journal] == [("reserve_inventory", 2)]
    assert sorted(tuple(r) for r in acted) == [("reserve", 1), ("reserve", 2)]


def test_a_provider_refuses_a_generation_older_than_the_newest_it_saw_for_the_order_and_task(
    shop: sa.Engine,
) -> None:
    providers = Providers(shop)
    providers.reserve("ord_1", "SKU-1", 1, task_id="t1", generation=2)
    with pytest.raises(StaleGeneration):  # another provider, same order and task: still refused
        providers.charge("ord_1", PARAMS_AMOUNT, task_id="t1", generation=1)
    # A flow's steps are tasks of their own, each counting generations from 1: not fenced by another task.
    assert providers.charge("ord_1", PARAMS_AMOUNT, task_id="t2", generation=1).startswith("pay_")
