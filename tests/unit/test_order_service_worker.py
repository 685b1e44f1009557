"""The order service's handler treats an unavailable business database as a retryable failure.

Regression (bench.chaos, issue 9): with connections cut and the business database crashed, a step's
``OperationalError`` was reported as not retryable, so the task FAILED and the order with it, in 35 of
10,000 orders after the card had been charged. Every step is journaled and every provider call carries
an idempotency key, so the next attempt resumes safely: the handler now raises ``RetryableError``.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from examples.order_service.worker import make_handler
from orbit_client import RetryableError
from orbit_client._worker import _error_for


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_business_database_that_is_down_makes_the_attempt_retryable() -> None:
    engine = sa.create_engine(
        f"mysql+pymysql://root@127.0.0.1:{_closed_port()}/shop", poolclass=sa.pool.NullPool
    )
    ctx: Any = SimpleNamespace(
        task=SimpleNamespace(id="t1"), generation=1, raise_if_cancelled=lambda: None,
        params={"order_id": "ord_1", "sku": "SKU-1", "quantity": 1, "amount": "10.00"},
    )  # fmt: skip
    with pytest.raises(RetryableError, match="business database unavailable") as raised:
        make_handler(engine)(ctx)
    assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
    assert _error_for(raised.value).retryable is True  # reported so: the server schedules another attempt
