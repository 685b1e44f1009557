"""The worker's report batching (orbit_client._reports) on a failure it does not expect, against respx mocks."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime
from typing import Any

import respx

from orbit_client import AsyncOrbitClient, AttemptLease, OrbitClient, RetryPolicy
from orbit_client._reports import AsyncReports, Reports

BASE = "https://orbit.test"
#: Body limit of the tests: each report below (about 1.6 KiB) travels in a request of its own.
LIMIT = 4096
RESULT = {"text": "x" * 1500}


def _attempt(n: int) -> AttemptLease:
    return AttemptLease(
        id=f"a-{n}", generation=1, lease_token=f"t-{n}", lease_expires_at=datetime(2026, 1, 1, tzinfo=UTC)
    )


class Broken(RuntimeError):
    """Not an OrbitError: e.g. a bug, or an error of a transport the client does not translate."""


@respx.mock
def test_an_unexpected_error_in_a_split_batch_answers_every_report() -> None:
    # Regression (issue 30, item 3): the batch was split into three requests; the first raised an
    # exception that is not an OrbitError, and only that request's report was answered: the threads of
    # the two others waited in future.result() for ever, and the worker's run() never returned.
    route = respx.post(f"{BASE}/v1/namespaces/acme/attempts/complete").mock(side_effect=Broken("boom"))
    raised: list[BaseException] = []
    with OrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as client:
        reports = Reports(client, "acme", linger=5.0, in_flight=lambda: 3, body_limit=LIMIT)

        def report(n: int) -> None:
            try:
                reports.complete(_attempt(n), RESULT)
            except BaseException as exc:
                raised.append(exc)

        threads = [threading.Thread(target=report, args=(n,), daemon=True) for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in threads), "a report was never answered"
    assert route.call_count == 1
    assert len(raised) == 3 and all(isinstance(exc, Broken) for exc in raised)


@respx.mock
async def test_an_unexpected_error_in_a_split_batch_answers_every_report_async() -> None:
    route = respx.post(f"{BASE}/v1/namespaces/acme/attempts/complete").mock(side_effect=Broken("boom"))
    async with AsyncOrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as client:
        reports = AsyncReports(client, "acme", linger=5.0, in_flight=lambda: 3, body_limit=LIMIT)
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(reports.complete(_attempt(n), RESULT) for n in range(3)), return_exceptions=True
            ),
            timeout=10,
        )
    assert route.call_count == 1
    assert all(isinstance(outcome, Broken) for outcome in outcomes), outcomes


def test_a_complete_item_holds_its_own_json_copy_of_the_result() -> None:
    """Validated once (no model -> JSON -> model round trip): still a copy of the handler's result, in
    JSON types, and a result that is not JSON is refused before anything is sent."""
    import enum

    import pytest

    from orbit_client import OrbitUsageError
    from orbit_client._reports import _complete_item

    class Colour(enum.StrEnum):
        RED = "red"

    attempt = AttemptLease(id="a-1", generation=1, lease_token="t", lease_expires_at=datetime.now(UTC))
    inner: dict[str, Any] = {"n": 2}
    item = _complete_item(attempt, {"colour": Colour.RED, "items": [1, inner]})
    inner["n"] = 3

    assert item.result == {"colour": "red", "items": [1, {"n": 2}]}
    assert isinstance(item.result, dict) and type(item.result["colour"]) is str
    assert (
        item.model_dump_json()
        == '{"lease_token":"t","result":{"colour":"red","items":[1,{"n":2}]},"attempt_id":"a-1"}'
    )
    with pytest.raises(OrbitUsageError, match="invalid complete request, nothing was sent: result"):
        _complete_item(attempt, {"bad": float("nan")})
