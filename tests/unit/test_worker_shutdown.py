"""The workers' shutdown when the lease path fails unexpectedly or ``run()`` is cancelled (respx mocks).

Each scenario runs in a daemon thread joined with a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import respx

from orbit_client import AsyncOrbitClient, AsyncWorker, OrbitClient, RetryPolicy, TaskContext, Worker

BASE = "https://orbit.test"
LEASES = f"{BASE}/v1/namespaces/acme/queues/q/leases"
SETTINGS = f"{BASE}/v1/settings"
#: Seconds a scenario may take before it counts as hung.
BOUND = 10.0


class Broken(RuntimeError):
    """Not an OrbitError: e.g. a bug, or an error of a transport the client does not translate."""


def _in_thread(target: object) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def body() -> None:
        try:
            target()  # type: ignore[operator]
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, raised


def _noop(ctx: TaskContext) -> None:
    return None


async def _async_noop(ctx: TaskContext) -> None:
    return None


@pytest.mark.parametrize("timeout", [None, 60.0])
def test_an_unexpected_error_from_the_lease_call_ends_run_with_that_error(timeout: float | None) -> None:
    # Regression: the error left the lease request counted as outstanding (Pipeline.asking), so run()
    # waited for its answer in its drain for ever (shutdown_timeout None) or for the whole shutdown_timeout.
    with respx.mock, OrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as client:
        respx.get(SETTINGS).mock(return_value=httpx.Response(404, json={"type": "not_found", "title": "x"}))
        route = respx.post(LEASES).mock(side_effect=Broken("boom"))
        worker = Worker(client, "acme", "q", {"h": _noop}, install_signal_handlers=False,
                        shutdown_timeout=timeout)  # fmt: skip
        thread, raised = _in_thread(worker.run)
        thread.join(BOUND)
        if thread.is_alive():
            worker.stop()
        assert not thread.is_alive(), "run() hung after an unexpected error from the lease call"
    assert route.call_count == 1
    assert len(raised) == 1 and isinstance(raised[0], Broken)


class _LongPoll(httpx.AsyncBaseTransport):
    """Answers ``GET /v1/settings`` with 404; holds every lease request until cancelled."""

    def __init__(self) -> None:
        self.polling = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/settings":
            return httpx.Response(404, json={"type": "not_found", "title": "x"})
        self.polling.set()
        try:
            await asyncio.Event().wait()  # a long poll that never answers
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


def test_cancelling_the_async_run_abandons_the_outstanding_lease_request() -> None:
    # Regression: the cancelled lease call left Pipeline.asking set, and run()'s drain waited for its
    # answer for ever: `task.cancel(); await task` never returned.
    transport = _LongPoll()
    outcome: list[str] = []

    async def scenario() -> None:
        async with AsyncOrbitClient(BASE, api_key="k", transport=transport,
                                    retry=RetryPolicy.no_wait()) as client:  # fmt: skip
            worker = AsyncWorker(client, "acme", "q", {"h": _async_noop}, install_signal_handlers=False,
                                 poll_wait_seconds=30)  # fmt: skip
            run = asyncio.create_task(worker.run())
            await asyncio.wait_for(transport.polling.wait(), BOUND)
            run.cancel()
            try:
                await run
            except asyncio.CancelledError:
                outcome.append("cancelled")
            assert transport.cancelled.is_set()  # the long poll was abandoned, not left running

    thread, raised = _in_thread(lambda: asyncio.run(scenario()))
    thread.join(BOUND)
    assert not thread.is_alive(), "the cancelled run() never finished"
    assert not raised, raised
    assert outcome == ["cancelled"]
