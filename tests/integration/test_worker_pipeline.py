"""The pipelined workers against a real server, on SQLite and MariaDB (DESIGN §4 "Pipelined
worker"), and the three defects of the serial worker, each with the scenario that showed it.

The server is made slow, or an answer is held back, by a transport wrapped around the real one
(:class:`HookedTransport`); what happened is read from the attempt rows, not from timings alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import AsyncOrbitClient, AsyncWorker, OrbitClient, RetryPolicy, TaskContext, Worker
from orbit_server.db.schema import task_attempts
from tests.conftest import DatabaseFactory
from tests.execution_support import check_attempt_history
from tests.integration.conftest import BACKENDS
from tests.integration.test_worker_batching import Recorder, kind_of
from tests.integration.test_worker_sdk import FAST, Env, running
from tests.servers import run_server

Hook = Callable[[httpx.Request, httpx.Response | None], None]


class HookedTransport(httpx.BaseTransport):
    """The real transport, with ``before(request, None)`` and ``after(request, response)`` hooks
    (they may sleep, to make the server slow, or wait for an event) and a :class:`Recorder`."""

    def __init__(self, recorder: Recorder, before: Hook | None = None, after: Hook | None = None) -> None:
        self.recorder, self.before, self.after = recorder, before, after
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.before is not None:
            self.before(request, None)
        injected = self.recorder.before(request)
        if injected is not None:
            return injected
        response = self.inner.handle_request(request)
        response.read()
        try:
            if self.after is not None:
                self.after(request, response)
            self.recorder.after(request, response)
        except BaseException:  # an answer "lost on the way back": its connection is closed, not leaked
            response.close()
            raise
        return response

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Env]:
    with run_server(make_database(request.param), sweep_interval_seconds=0.1) as server:
        environment = Env(server)
        yield environment
        environment.admin.close()


def client_for(env: Env, transport: httpx.BaseTransport) -> OrbitClient:
    return OrbitClient(
        env.server.base_url,
        api_key=env.keys["work"],
        transport=transport,
        retry=RetryPolicy(backoff_base=0.01),
    )


def attempt_rows(env: Env, ids: list[str]) -> list[dict[str, Any]]:
    with env.server.engine.connect() as conn:
        rows = conn.execute(sa.select(task_attempts).where(task_attempts.c.task_id.in_(ids))).mappings().all()
    return [dict(row) for row in rows]


def most_held_at_once(rows: list[dict[str, Any]]) -> int:
    """The most attempts whose [leased_at, finished_at) overlap (database clock)."""
    edges = sorted(itertools.chain.from_iterable(((r["leased_at"], 1), (r["finished_at"], -1)) for r in rows),
                   key=lambda edge: (edge[0], edge[1]))  # fmt: skip
    held = most = 0
    for _, step in edges:
        held += step
        most = max(most, held)
    return most


def _naive_utc(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value


# ------------------------------------------------------------------------------ the pipeline


def test_a_slow_server_and_short_leases_never_make_a_grant_wait_past_its_lease(env: Env) -> None:
    # Every answer takes 0.15 s more; leases are 8 s; handlers take 2.2 s, longer than a quarter
    # lease: the worker prefetches nothing (it holds at most one grant per slot), nothing lapses.
    # (With 4 s leases and 1.2 s handlers, one attempt lapsed in a CI run at load ~8, where an answer
    # can take the 2.7 s a third-of-a-lease heartbeat has left.)
    queue = env.queue()
    ids = [env.submit(queue, "slow", {"n": n}, retry_safe=False, max_attempts=1) for n in range(6)]
    began: dict[str, datetime] = {}

    def slow(ctx: TaskContext) -> Any:
        began[ctx.attempt_id] = datetime.now(UTC).replace(tzinfo=None)
        time.sleep(2.2)
        return ctx.params

    def sluggish(request: httpx.Request, response: httpx.Response | None) -> None:
        time.sleep(0.15)

    recorder = Recorder()
    with (
        client_for(env, HookedTransport(recorder, after=sluggish)) as client,
        running(Worker(client, env.ns, queue, {"slow": slow}, concurrency=2, lease_seconds=8.0, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED", "FAILED", "NEEDS_REVIEW", timeout=60)
    rows = attempt_rows(env, ids)
    assert len(rows) == len(ids) and {r["status"] for r in rows} == {"SUCCEEDED"}
    assert {env.admin.get_task(env.ns, i).status for i in ids} == {"SUCCEEDED"}
    assert most_held_at_once(rows) <= 2
    for row in rows:  # every handler began before its lease could have lapsed
        assert began[row["id"]] < _naive_utc(row["leased_at"]) + timedelta(seconds=8.0)
    check_attempt_history(env.server.engine, ids)


def test_short_handlers_are_prefetched_and_each_starts_within_a_quarter_of_its_lease(env: Env) -> None:
    queue = env.queue()
    ids = [env.submit(queue, "quick", {"n": n}, retry_safe=True) for n in range(60)]
    began: dict[str, datetime] = {}

    def quick(ctx: TaskContext) -> Any:
        began[ctx.attempt_id] = datetime.now(UTC).replace(tzinfo=None)
        time.sleep(0.01)
        return ctx.params

    recorder = Recorder()
    lease = 10.0
    with (
        client_for(env, HookedTransport(recorder)) as client,
        running(Worker(client, env.ns, queue, {"quick": quick}, concurrency=2, lease_seconds=lease, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED", timeout=40)
    rows = attempt_rows(env, ids)
    assert len(rows) == len(ids)
    # More held than slots (the pipeline), never more than slots + the cap (default_prefetch: 16 here).
    assert 2 < most_held_at_once(rows) <= 2 + 16
    slack = timedelta(seconds=1.0)  # the answer's way back on a loaded machine
    for row in rows:
        assert began[row["id"]] - _naive_utc(row["leased_at"]) <= timedelta(seconds=lease / 4) + slack
    # Most leases ride on the reports; no start calls.
    with recorder.lock:
        kinds = [s.kind for s in recorder.sent]
    assert "start (batch)" not in kinds and "start" not in kinds
    assert kinds.count("lease") < kinds.count("complete (batch)"), kinds
    assert len([k for k in kinds if k != "settings"]) < len(ids)
    check_attempt_history(env.server.engine, ids)


def test_one_slot_keeps_grants_in_hand_while_its_reports_are_on_their_way(env: Env) -> None:
    # One slot, instant handlers, default tasks (each confirmed by a start on its path), and complete
    # batches answered 40 ms late: the next grants ride on those batches, so the grants in hand must
    # last a batch's linger and round trip. With four in hand (the old default cap, 4 × concurrency)
    # the slot ran dry at every batch (bench.timeline at concurrency 1: 62% of the wall time waiting
    # for a lease); the default cap is now at least 16 (orbit_client._pipeline.default_prefetch).
    queue = env.queue()
    ids = [env.submit(queue, "instant", {"n": n}) for n in range(80)]

    def late_reports(request: httpx.Request, response: httpx.Response | None) -> None:
        if kind_of(request) == "complete (batch)":
            time.sleep(0.04)

    recorder = Recorder()
    with (
        client_for(env, HookedTransport(recorder, after=late_reports)) as client,
        running(Worker(client, env.ns, queue, {"instant": lambda ctx: None}, concurrency=1, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED", timeout=60)
    rows = attempt_rows(env, ids)
    assert len(rows) == len(ids) and {r["status"] for r in rows} == {"SUCCEEDED"}
    assert 1 + 4 < most_held_at_once(rows) <= 1 + 16
    check_attempt_history(env.server.engine, ids)


def test_the_async_worker_is_pipelined_alike(env: Env) -> None:
    queue = env.queue()
    ids = [env.submit(queue, "quick", {"n": n}, retry_safe=True) for n in range(30)]
    recorder = Recorder()

    async def quick(ctx: TaskContext) -> Any:
        await asyncio.sleep(0.005)
        return ctx.params

    class AsyncHooked(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            recorder.before(request)
            response = await self.inner.handle_async_request(request)
            await response.aread()
            recorder.after(request, response)
            return response

        async def aclose(self) -> None:  # the client closes its transport: close the real one's pool
            await self.inner.aclose()

    async def scenario() -> None:
        async with AsyncOrbitClient(
            env.server.base_url, api_key=env.keys["work"], transport=AsyncHooked()
        ) as client:
            worker = AsyncWorker(client, env.ns, queue, {"quick": quick}, concurrency=3, **FAST)
            runner = asyncio.create_task(worker.run())
            for task_id in ids:
                await asyncio.to_thread(env.wait, task_id, "SUCCEEDED")
            worker.stop()
            await asyncio.wait_for(runner, 20)

    asyncio.run(scenario())
    with recorder.lock:
        kinds = [s.kind for s in recorder.sent]
    assert "start (batch)" not in kinds
    assert "complete (batch)" in kinds
    assert len([k for k in kinds if k != "settings"]) < len(ids)
    rows = attempt_rows(env, ids)
    assert len(rows) == len(ids)
    # More held than slots (the pipeline: grants in hand while the slots run), never more than slots +
    # the cap (default_prefetch: 16 here).
    assert 3 < most_held_at_once(rows) <= 3 + 16
    check_attempt_history(env.server.engine, ids)


def generation(ctx: TaskContext) -> int:
    return ctx.generation


def test_a_lost_lease_and_start_answer_never_leaves_a_task_running(env: Env) -> None:
    queue = env.queue()
    ids = [env.submit(queue, "echo", {"n": n}, retry_safe=True, backoff_base_seconds=0) for n in range(2)]
    recorder = Recorder(faults={"lease": "lose"})
    with (
        client_for(env, HookedTransport(recorder)) as client,
        # 3 s: the lost grants lapse after it; the second grants must keep theirs from grant to report (with
        # 1.5 s, a worker stalled that long by a loaded machine would lose them: a third attempt).
        running(Worker(client, env.ns, queue, {"echo": generation}, concurrency=2, lease_seconds=3, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED")
    for task_id in ids:
        first, second = env.admin.list_attempts(env.ns, task_id)
        assert first.status == "EXPIRED" and first.started_at is None  # never started, never NEEDS_REVIEW
        assert second.status == "SUCCEEDED" and env.admin.get_task(env.ns, task_id).result == 2
    check_attempt_history(env.server.engine, ids)


# ------------------------------------------------------------------------------ the defects


def test_reports_each_under_the_body_limit_but_over_it_together_all_succeed(env: Env) -> None:
    # Four ~90 KB results finishing together: one batch of them is over the server's 256 KiB.
    queue = env.queue()
    ids = [env.submit(queue, "big", {"n": n}) for n in range(4)]
    release = threading.Barrier(4)

    def big(ctx: TaskContext) -> Any:
        release.wait(10)
        return {"n": ctx.params["n"], "blob": "x" * 90_000}

    recorder = Recorder()
    with (
        client_for(env, HookedTransport(recorder)) as client,
        running(Worker(client, env.ns, queue, {"big": big}, concurrency=4, report_linger=0.5, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED", "NEEDS_REVIEW", "FAILED")
    assert [env.admin.get_task(env.ns, i).status for i in ids] == ["SUCCEEDED"] * 4
    assert sum(recorder.items("complete (batch)")) == 4 and len(recorder.items("complete (batch)")) >= 2
    check_attempt_history(env.server.engine, ids)


def test_a_batch_refused_whole_as_too_large_is_sent_again_report_by_report(env: Env) -> None:
    queue = env.queue()
    ids = [env.submit(queue, "echo", {"n": n}) for n in range(3)]
    barrier = threading.Barrier(3)
    refused = threading.Event()

    def echo(ctx: TaskContext) -> Any:
        barrier.wait(10)
        return ctx.params

    refused_items: list[int] = []

    def too_large_once(request: httpx.Request, _response: httpx.Response | None) -> None:
        if kind_of(request) == "complete (batch)" and not refused.is_set():
            refused.set()
            refused_items.append(len(json.loads(request.content)["items"]))
            raise _Refuse()

    class _Refuse(Exception):
        pass

    class Refusing(HookedTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            try:
                if self.before is not None:
                    self.before(request, None)
            except _Refuse:  # a proxy with a smaller limit than the server's
                body = {"title": "Payload too large", "status": 413, "code": "payload_too_large"}
                return httpx.Response(413, json=body, headers={"content-type": "application/problem+json"})
            return super().handle_request(request)

    recorder = Recorder()
    transport = Refusing(recorder, before=too_large_once)
    with (
        client_for(env, transport) as client,
        running(Worker(client, env.ns, queue, {"echo": echo}, concurrency=3, report_linger=0.5, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED", "NEEDS_REVIEW", "FAILED")
    assert refused.is_set()
    assert [env.admin.get_task(env.ns, i).status for i in ids] == ["SUCCEEDED"] * 3
    assert recorder.count("complete") == refused_items[0]  # each alone after the whole batch was refused
    check_attempt_history(env.server.engine, ids)


def test_slow_report_answers_never_make_a_grant_wait_past_its_lease(env: Env) -> None:
    # Concurrency 1, complete answers later than a whole lease, one attempt per task: the serial
    # worker leased the next task while its only thread was still reporting, and that grant waited
    # unheartbeated past its lease (FAILED attempts_exhausted, though no handler ever saw it).
    queue = env.queue()
    ids = [env.submit(queue, "echo", {"n": n}, max_attempts=1) for n in range(3)]
    ran: list[int] = []

    def echo(ctx: TaskContext) -> Any:
        ran.append(ctx.params["n"])
        return ctx.params

    def late_completes(request: httpx.Request, _response: httpx.Response | None) -> None:
        if kind_of(request).startswith("complete"):
            time.sleep(5.0)

    recorder = Recorder()
    with (
        client_for(env, HookedTransport(recorder, after=late_completes)) as client,
        # Leases of 4 s, answers 5 s late (with 2 s leases a grant lapsed on a machine at load 7).
        running(Worker(client, env.ns, queue, {"echo": echo}, concurrency=1, lease_seconds=4.0, **FAST)),
    ):
        for task_id in ids:
            env.wait(task_id, "SUCCEEDED", "FAILED", "NEEDS_REVIEW", timeout=60)
    assert [env.admin.get_task(env.ns, i).status for i in ids] == ["SUCCEEDED"] * 3
    assert sorted(ran) == [0, 1, 2]
    assert {r["status"] for r in attempt_rows(env, ids)} == {"SUCCEEDED"}
    check_attempt_history(env.server.engine, ids)


def test_a_heartbeat_that_races_a_successful_complete_is_no_lost_lease(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # The complete is committed, but its answer is held back until a heartbeat sent after it has
    # been answered (409: the attempt is SUCCEEDED); the heartbeats go on while a report is on its
    # way. The lease is not what is tested: 3 s (a heartbeat every second). With 1.2 s, a worker
    # stalled by a loaded machine could let it lapse before its complete, which then really was late.
    queue = env.queue()
    task_id = env.submit(queue, "echo")
    contexts: list[TaskContext] = []
    beaten, completed, beaten_after, released = (threading.Event() for _ in range(4))

    def echo(ctx: TaskContext) -> Any:
        contexts.append(ctx)
        assert beaten.wait(30)  # past the first heartbeat: the lease is renewed while the handler runs
        return "done"

    def mark(request: httpx.Request, _response: httpx.Response | None) -> None:
        request.extensions["after_complete"] = completed.is_set()  # sent once the complete was committed

    def hold_complete(request: httpx.Request, response: httpx.Response | None) -> None:
        kind = kind_of(request)
        if kind.startswith("heartbeat"):
            (beaten_after if request.extensions["after_complete"] else beaten).set()
        elif kind.startswith("complete"):
            completed.set()
            beaten_after.wait(30)
            released.set()

    recorder = Recorder()
    caplog.set_level(logging.WARNING, logger="orbit_client.worker")
    with (
        client_for(env, HookedTransport(recorder, before=mark, after=hold_complete)) as client,
        running(Worker(client, env.ns, queue, {"echo": echo}, lease_seconds=3, **FAST)),
    ):
        env.wait(task_id, "SUCCEEDED")
        assert released.wait(60)  # the complete's answer goes back once the heartbeat's has
    assert beaten_after.is_set(), "no heartbeat met the complete: the race did not happen"
    assert env.admin.get_task(env.ns, task_id).status == "SUCCEEDED"
    assert not [r for r in caplog.records if "lost its lease" in r.getMessage()]
    assert not contexts[0].lease_lost
