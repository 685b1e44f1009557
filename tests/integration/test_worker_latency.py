"""A worker that has leased in bulk (``Pipeline.want``: no ask while a round of grants is in hand) still
starts a task submitted one at a time at once, with a long poll as its only way to hear of it, at every
concurrency, thread or async, with a slot held by a slow handler meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orbit_client import AsyncOrbitClient, AsyncWorker, TaskContext, Worker
from tests.conftest import DatabaseFactory
from tests.integration.test_worker_sdk import Env
from tests.servers import run_server

#: A long poll longer than any latency allowed: a task is heard of by the poll waiting for it (a stop waits
#: for the poll outstanding: not longer, to keep the test short).
SETTINGS: dict[str, Any] = {"poll_wait_seconds": 2.5, "install_signal_handlers": False}
#: Most seconds from a submit to its handler's start (an idle worker, a local server).
LATENCY = 1.0


@pytest.fixture(scope="module")
def env(make_database: DatabaseFactory) -> Iterator[Env]:
    with run_server(make_database("sqlite"), sweep_interval_seconds=0.2) as server:
        environment = Env(server)
        yield environment
        environment.admin.close()


class Starts:
    """When each task's handler began, by its params' ``n``; ``slow`` handlers hold their slot until released."""

    def __init__(self) -> None:
        self.began: dict[int, float] = {}
        self.changed = threading.Condition()
        self.release = threading.Event()

    def begin(self, ctx: TaskContext) -> None:
        with self.changed:
            self.began[ctx.params["n"]] = time.monotonic()
            self.changed.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> float:
        with self.changed:
            assert self.changed.wait_for(lambda: n in self.began, timeout), f"task {n} never began"
            return self.began[n]


def _scenario(env: Env, queue: str, starts: Starts, concurrency: int) -> list[float]:
    """Warm up (a burst, so the worker knows its handlers are short and prefetches), hold one slot with a
    slow handler when there are two or more, then submit tasks one at a time: each one's latency."""
    burst = 40
    for n in range(burst):
        env.submit(queue, "quick", {"n": n})
    for n in range(burst):
        starts.wait(n)
    n = burst
    if concurrency > 1:
        env.submit(queue, "slow", {"n": n})
        starts.wait(n)
        n += 1
    latencies = []
    for _ in range(3 * concurrency + 2):
        sent = time.monotonic()
        env.submit(queue, "quick", {"n": n})
        latencies.append(starts.wait(n) - sent)
        n += 1
    starts.release.set()
    return latencies


@pytest.mark.parametrize(("concurrency", "prefetch"), [(1, None), (2, None), (8, None), (1, 0), (3, 2)])
def test_a_task_submitted_alone_starts_at_once_after_a_burst(
    env: Env, concurrency: int, prefetch: int | None
) -> None:
    queue, starts = env.queue(), Starts()

    def quick(ctx: TaskContext) -> Any:
        starts.begin(ctx)

    def slow(ctx: TaskContext) -> Any:
        starts.begin(ctx)
        starts.release.wait(30)

    with env.client() as client:
        worker = Worker(client, env.ns, queue, {"quick": quick, "slow": slow}, concurrency=concurrency,
                        prefetch=prefetch, **SETTINGS)  # fmt: skip
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            latencies = _scenario(env, queue, starts, concurrency)
        finally:
            starts.release.set()
            worker.stop()
            thread.join(30)
    assert max(latencies) < LATENCY, latencies


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_async_worker_starts_a_task_submitted_alone_at_once_after_a_burst(
    env: Env, concurrency: int
) -> None:
    queue, starts = env.queue(), Starts()

    async def quick(ctx: TaskContext) -> Any:
        starts.begin(ctx)

    async def slow(ctx: TaskContext) -> Any:
        starts.begin(ctx)
        await asyncio.to_thread(starts.release.wait, 30)

    latencies: list[float] = []

    async def main() -> None:
        async with AsyncOrbitClient(env.server.base_url, api_key=env.keys["work"]) as client:
            worker = AsyncWorker(client, env.ns, queue, {"quick": quick, "slow": slow}, concurrency=concurrency,
                                 **SETTINGS)  # fmt: skip
            runner = asyncio.create_task(worker.run())
            try:
                latencies.extend(await asyncio.to_thread(_scenario, env, queue, starts, concurrency))
            finally:
                starts.release.set()
                worker.stop()
                await asyncio.wait_for(runner, 30)

    asyncio.run(main())
    assert max(latencies) < LATENCY, latencies
