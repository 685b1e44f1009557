"""``TaskDefinition``: a task declared once (handler, queue, options, params model); wrong params fail
where they are given, with every field named, and the handler receives the model."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel, Field

from orbit_client import OrbitUsageError, SubmitOptions, Task, TaskContext, TaskDefinition, TaskStatus


class FulfilParams(BaseModel):
    order_id: int = Field(ge=1)
    amount: Decimal
    due: datetime | None = None


FULFIL = TaskDefinition(
    "orders.fulfil", FulfilParams, queue="fulfilment", options={"retry_safe": True, "max_attempts": 3}
)


def _ctx(params: Any) -> TaskContext:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    task = Task(id="t1", namespace="shop", queue="fulfilment", handler="orders.fulfil", params=params,
                status=TaskStatus.RUNNING, state_version=1, attempt_count=1, max_attempts=3, available_at=now,
                created_at=now, updated_at=now)  # fmt: skip
    return TaskContext(task=task, namespace="shop", attempt_id="a1", generation=1, worker_id="w")


def test_params_are_validated_and_stored_as_the_models_json() -> None:
    due = datetime(2030, 5, 6, 7, 8, 9, tzinfo=UTC)
    expected = {"order_id": 42, "amount": "9.90", "due": "2030-05-06T07:08:09Z"}
    assert FULFIL.dump(FulfilParams(order_id=42, amount=Decimal("9.90"), due=due)) == expected
    assert FULFIL.dump({"order_id": 42, "amount": "9.90", "due": due}) == expected


def test_wrong_params_name_every_field() -> None:
    with pytest.raises(OrbitUsageError) as raised:
        FULFIL.dump({"order_id": 0, "amount": "lots"})
    message = str(raised.value)
    assert "'orders.fulfil'" in message and "FulfilParams" in message
    assert "order_id: Input should be greater than or equal to 1" in message and "amount:" in message
    changed = FulfilParams(order_id=1, amount=Decimal(1))
    changed.order_id = -5  # a model changed after validation is checked again
    with pytest.raises(OrbitUsageError, match="order_id"):
        FULFIL.dump(changed)


def test_a_definition_is_checked_when_declared() -> None:
    with pytest.raises(OrbitUsageError, match="pydantic BaseModel subclass"):
        TaskDefinition("x", dict)  # type: ignore[type-var]
    with pytest.raises(OrbitUsageError, match="handler"):
        TaskDefinition("", FulfilParams)
    with pytest.raises(OrbitUsageError, match="max_attempts"):
        TaskDefinition("x", FulfilParams, options={"max_attempts": 0})


def test_options_given_at_submission_override_the_definitions_field_by_field() -> None:
    merged = FULFIL.merged_options({"max_attempts": 7})
    assert merged == SubmitOptions(retry_safe=True, max_attempts=7)
    assert FULFIL.merged_options(None) == SubmitOptions(retry_safe=True, max_attempts=3)


def test_the_handler_receives_the_model_and_wrong_params_never_reach_it() -> None:
    seen: list[FulfilParams] = []

    def fulfil(ctx: TaskContext, params: FulfilParams) -> int:
        seen.append(params)
        return params.order_id

    handler = FULFIL.handle(fulfil)
    assert handler(_ctx({"order_id": 3, "amount": "1"})) == 3
    assert isinstance(seen[0], FulfilParams) and seen[0].amount == Decimal(1)
    with pytest.raises(OrbitUsageError, match="order_id"):
        handler(_ctx({"amount": "1"}))
    assert len(seen) == 1


def test_a_coroutine_gives_a_coroutine_handler() -> None:
    async def fulfil(ctx: TaskContext, params: FulfilParams) -> int:
        return params.order_id * 2

    handler = FULFIL.handle(fulfil)
    assert asyncio.iscoroutinefunction(handler)
    assert asyncio.run(handler(_ctx({"order_id": 4, "amount": "1"}))) == 8  # type: ignore[arg-type]
