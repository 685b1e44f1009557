"""The timeline of one task at concurrency 1: where a worker's wall time goes, call by call.

    python -m bench.timeline [--server-db sqlite|mariadb|postgres] [--tasks 200] [--trickle 40]
                             [--worker thread|async] [--retry-safe] [--handler-ms 0] [--json-file PATH]

One ``orbit-server serve`` process on a new database, one worker at its defaults (``Worker``, or
``AsyncWorker`` with ``--worker async``: concurrency 1, default report linger, prefetch and lease
settings) serving one queue, two rounds:

1. **backlog**: ``--tasks`` tasks submitted beforehand, then the worker drains them;
2. **trickle**: ``--trickle`` tasks submitted one at a time, each once the previous one is complete
   and the worker's next lease request has been waiting (long-polling) for 50 ms.

The worker's client goes through a recording ``httpx`` transport (no product code changes): each
request's send and answer times (``time.monotonic()``) with the task and attempt ids its body and
answer name; the handler records its begin and end. For each task that gives: submit committed (its
answer received), lease sent/answered (the call, a lease or a report carrying one, whose answer
granted it), start sent/answered, handler begin/end, complete sent/answered, and the next task's
lease sent/answered. It prints the timeline of the median task (by wall time) and the median of each
gap, per-task wall time and tasks/s, and writes ``bench/results/timeline-<UTC>-<commit>.json``
(``--json-file PATH`` elsewhere, ``-`` nowhere) with the run's provenance (``run_provenance``).

Times are milliseconds, relative to the task's submit answer in the trickle round and to its lease
request's send in the backlog round (its submit is long past there). Run it on demand on a quiet
machine; the load average is in the file and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench._support import cli, migrated_mariadb, orbit_server_processes, run_provenance
from orbit_client import AsyncOrbitClient, AsyncWorker, OrbitClient, TaskContext, Worker

NAMESPACE = "bench"
HANDLER = "bench.echo"
RESULTS = Path(__file__).resolve().parent / "results"
#: The events of one task, in the order of its cycle (``next lease`` is the following task's lease).
EVENTS = (
    "submit committed",
    "lease sent",
    "lease answered",
    "start sent",
    "start answered",
    "handler begin",
    "handler end",
    "complete sent",
    "complete answered",
    "next lease sent",
    "next lease answered",
)
#: The gaps whose medians are printed: (name, from event, to event).
GAPS = (
    ("submit → grant answered", "submit committed", "lease answered"),
    ("lease answered → start sent", "lease answered", "start sent"),
    ("start round trip", "start sent", "start answered"),
    ("start answered → handler begin", "start answered", "handler begin"),
    ("lease answered → handler begin", "lease answered", "handler begin"),
    ("handler", "handler begin", "handler end"),
    ("handler end → complete sent (linger)", "handler end", "complete sent"),
    ("complete round trip", "complete sent", "complete answered"),
    ("handler end → next lease sent", "handler end", "next lease sent"),
    ("handler end → next handler begin", "handler end", "next handler begin"),
)


# ------------------------------------------------------------------------------------------ recording


@dataclass
class Call:
    """One request of the worker's client as the transport saw it."""

    kind: str  # lease, start, complete, fail, heartbeat, settings, other
    sent: float
    answered: float
    attempts: list[str]  # attempt ids the request names
    grants: list[tuple[str, str]]  # (task id, attempt id) the answer grants
    rides: bool = False  # a report batch carrying a lease request


def _kind(path: str) -> str:
    if path.endswith("/leases"):
        return "lease"
    for action in ("start", "complete", "fail", "heartbeat"):
        if path.endswith("/" + action) or path.endswith("/" + action + "s"):
            return action
    return "settings" if path.endswith("/settings") else "other"


def _parse(request: httpx.Request, content: bytes, sent: float, answered: float) -> Call:
    path = request.url.path
    kind = _kind(path)
    body: Any = json.loads(request.content) if request.content else {}
    attempts = [item["attempt_id"] for item in body.get("items", [])] if isinstance(body, dict) else []
    if not attempts and "/attempts/" in path and kind in ("start", "complete", "fail", "heartbeat"):
        attempts = [path.split("/attempts/")[1].split("/")[0]]
    answer: Any = json.loads(content) if content else None
    grants: list[dict[str, Any]] = []
    if kind == "lease" and isinstance(answer, list):
        grants = answer
    elif isinstance(answer, dict) and isinstance(answer.get("grants"), list):
        grants = answer["grants"]
    return Call(
        kind, sent, answered, attempts, [(g["task"]["id"], g["attempt"]["id"]) for g in grants],
        rides=isinstance(body, dict) and "lease" in body,
    )  # fmt: skip


class _Log:
    """The calls recorded so far, and who waits for a lease request to be sent (thread-safe)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.leases_waiting = 0  # lease requests sent and not answered yet
        self.cond = threading.Condition()

    def sending(self, request: httpx.Request) -> None:
        if _kind(request.url.path) == "lease":
            with self.cond:
                self.leases_waiting += 1
                self.cond.notify_all()

    def answered(self, request: httpx.Request, content: bytes, sent: float) -> None:
        call = _parse(request, content, sent, time.monotonic())
        with self.cond:
            if call.kind == "lease":
                self.leases_waiting -= 1
            self.calls.append(call)
            self.cond.notify_all()


class Recording(httpx.BaseTransport):
    """An ``httpx`` transport that records each request's send and answer times (``_Log``)."""

    def __init__(self, log: _Log) -> None:
        self.log = log
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.log.sending(request)
        sent = time.monotonic()
        response = self.inner.handle_request(request)
        content = response.read()
        self.log.answered(request, content, sent)
        return response

    def close(self) -> None:
        self.inner.close()


class AsyncRecording(httpx.AsyncBaseTransport):
    """The asyncio twin of :class:`Recording`."""

    def __init__(self, log: _Log) -> None:
        self.log = log
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.log.sending(request)
        sent = time.monotonic()
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        self.log.answered(request, content, sent)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class Handled:
    """What the handler and the submitter saw of each task, by task id."""

    begin: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    submitted: dict[str, float] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def began(self, task_id: str) -> None:
        self.begin[task_id] = time.monotonic()

    def ended(self, task_id: str) -> None:
        with self.cond:
            self.end[task_id] = time.monotonic()
            self.cond.notify_all()


# ------------------------------------------------------------------------------------------ the worker


class RunningWorker:
    """A worker at its defaults in a thread of its own (``Worker``, or ``AsyncWorker`` on a loop)."""

    def __init__(
        self, kind: str, base: str, key: str, queue: str, log: _Log, handled: Handled, handler_s: float
    ):
        self.kind = kind
        self._thread = threading.Thread(target=self._run, args=(base, key, queue, log, handled, handler_s),
                                        name="bench-worker", daemon=True)  # fmt: skip
        self._ready = threading.Event()
        self._stop: Any = None
        self.error: BaseException | None = None

    def __enter__(self) -> RunningWorker:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._stop is not None:
            self._stop()
        self._thread.join(60)
        if self.error is not None:
            raise self.error

    def _run(self, base: str, key: str, queue: str, log: _Log, handled: Handled, handler_s: float) -> None:
        try:
            if self.kind == "thread":

                def handler(ctx: TaskContext) -> Any:
                    handled.began(ctx.task.id)
                    if handler_s:
                        time.sleep(handler_s)
                    handled.ended(ctx.task.id)
                    return {"ok": True}

                with OrbitClient(base, api_key=key, transport=Recording(log)) as client:
                    worker = Worker(
                        client, NAMESPACE, queue, {HANDLER: handler}, install_signal_handlers=False
                    )
                    self._stop = worker.stop
                    self._ready.set()
                    worker.run()
            else:
                asyncio.run(self._run_async(base, key, queue, log, handled, handler_s))
        except BaseException as exc:  # reported by __exit__
            self.error = exc
            self._ready.set()

    async def _run_async(
        self, base: str, key: str, queue: str, log: _Log, handled: Handled, handler_s: float
    ) -> None:
        async def handler(ctx: TaskContext) -> Any:
            handled.began(ctx.task.id)
            if handler_s:
                await asyncio.sleep(handler_s)
            handled.ended(ctx.task.id)
            return {"ok": True}

        async with AsyncOrbitClient(base, api_key=key, transport=AsyncRecording(log)) as client:
            worker = AsyncWorker(client, NAMESPACE, queue, {HANDLER: handler}, install_signal_handlers=False)
            self._stop = worker.stop
            self._ready.set()
            await worker.run()


# ------------------------------------------------------------------------------------------ rounds


def _wait_for(cond: threading.Condition, ready: Any, timeout: float, what: str) -> None:
    with cond:
        if not cond.wait_for(ready, timeout):
            raise SystemExit(f"timed out waiting for {what}")


def backlog_round(base: str, keys: dict[str, str], args: argparse.Namespace, queue: str) -> dict[str, Any]:
    """``args.tasks`` tasks submitted first, then drained by one worker."""
    log, handled = _Log(), Handled()
    options = {"retry_safe": True} if args.retry_safe else None
    with OrbitClient(base, api_key=keys["submit"]) as submitter:
        for n in range(args.tasks):
            result = submitter.submit_task(NAMESPACE, queue, HANDLER, {"n": n},
                                           idempotency_key=uuid.uuid4().hex, options=options)  # fmt: skip
            handled.submitted[result.task.id] = time.monotonic()
    with RunningWorker(args.worker, base, keys["work"], queue, log, handled, args.handler_ms / 1000):
        _wait_for(handled.cond, lambda: len(handled.end) >= args.tasks, 600, "the backlog to drain")
        _wait_for(log.cond, lambda: _completes_answered(log, handled) >= args.tasks, 60, "the last complete")
    return analyse("backlog", log, handled, reference="lease sent")


def trickle_round(base: str, keys: dict[str, str], args: argparse.Namespace, queue: str) -> dict[str, Any]:
    """``args.trickle`` tasks, each submitted while the worker idles in a long-poll lease."""
    log, handled = _Log(), Handled()
    options = {"retry_safe": True} if args.retry_safe else None
    with (
        OrbitClient(base, api_key=keys["submit"]) as submitter,
        RunningWorker(args.worker, base, keys["work"], queue, log, handled, args.handler_ms / 1000),
    ):
        for n in range(args.trickle):
            # The previous task is complete and a lease request is waiting on the server.
            _wait_for(log.cond, lambda n=n: _completes_answered(log, handled) >= n and log.leases_waiting > 0,
                      60, "the worker to idle in a lease")  # fmt: skip
            time.sleep(0.05)  # let the long poll settle into its wait (a bench, not a test)
            result = submitter.submit_task(NAMESPACE, queue, HANDLER, {"n": n},
                                           idempotency_key=uuid.uuid4().hex, options=options)  # fmt: skip
            handled.submitted[result.task.id] = time.monotonic()
        _wait_for(
            log.cond, lambda: _completes_answered(log, handled) >= args.trickle, 60, "the last complete"
        )
    return analyse("trickle", log, handled, reference="submit committed")


def _completes_answered(log: _Log, handled: Handled) -> int:
    return sum(len(call.attempts) for call in log.calls if call.kind in ("complete", "fail"))


# ------------------------------------------------------------------------------------------ analysis


def _events(log: _Log, handled: Handled) -> list[dict[str, float]]:
    """Per task (in handler order) each event's ``time.monotonic()``."""
    calls = sorted(log.calls, key=lambda c: c.sent)
    attempt_of: dict[str, str] = {}
    granted_by: dict[str, Call] = {}
    for call in calls:
        for task_id, attempt_id in call.grants:
            attempt_of[task_id] = attempt_id
            granted_by[task_id] = call
    by_attempt: dict[tuple[str, str], Call] = {}
    for call in calls:
        for attempt_id in call.attempts:
            by_attempt.setdefault((call.kind, attempt_id), call)
    order = sorted(handled.begin, key=handled.begin.__getitem__)
    tasks: list[dict[str, float]] = []
    for task_id in order:
        attempt = attempt_of.get(task_id)
        lease = granted_by.get(task_id)
        ev: dict[str, float] = {"submit committed": handled.submitted[task_id]}
        if lease is not None:
            ev["lease sent"], ev["lease answered"] = lease.sent, lease.answered
        if attempt is not None and (start := by_attempt.get(("start", attempt))) is not None:
            ev["start sent"], ev["start answered"] = start.sent, start.answered
        ev["handler begin"], ev["handler end"] = handled.begin[task_id], handled.end[task_id]
        if attempt is not None and (complete := by_attempt.get(("complete", attempt))) is not None:
            ev["complete sent"], ev["complete answered"] = complete.sent, complete.answered
            ev["rides"] = float(complete.rides)
        tasks.append(ev)
    for ev, nxt in itertools.pairwise(tasks):
        if "lease sent" in nxt:
            ev["next lease sent"], ev["next lease answered"] = nxt["lease sent"], nxt["lease answered"]
        ev["next handler begin"] = nxt["handler begin"]
    return tasks


def analyse(name: str, log: _Log, handled: Handled, *, reference: str) -> dict[str, Any]:
    tasks = _events(log, handled)
    walls = [
        ev["complete answered"] - ev[reference]
        for ev in tasks
        if "complete answered" in ev and reference in ev
    ]
    gaps: dict[str, float | None] = {}
    for label, a, b in GAPS:
        values = [ev[b] - ev[a] for ev in tasks if a in ev and b in ev]
        gaps[label] = round(statistics.median(values) * 1000, 3) if values else None
    first = min(min(v for k, v in ev.items() if k in EVENTS and k != "submit committed") for ev in tasks)
    last = max(ev.get("complete answered", ev["handler end"]) for ev in tasks)
    # The median task: the one whose wall time is the median.
    ranked = sorted((ev for ev in tasks if "complete answered" in ev and reference in ev),
                    key=lambda ev: ev["complete answered"] - ev[reference])  # fmt: skip
    median_task = ranked[len(ranked) // 2]
    zero = median_task[reference]
    timeline = [
        {"event": e, "ms": round((median_task[e] - zero) * 1000, 3)} for e in EVENTS if e in median_task
    ]
    kinds: dict[str, int] = {}
    for call in log.calls:
        kinds[call.kind] = kinds.get(call.kind, 0) + 1
    return {
        "round": name,
        "tasks": len(tasks),
        "reference": reference,
        "median_task": timeline,
        "gaps_ms_median": gaps,
        "wall_ms_median": round(statistics.median(walls) * 1000, 3),
        "wall_ms_p90": round(sorted(walls)[int(0.9 * (len(walls) - 1))] * 1000, 3),
        "tasks_per_s": round(len(tasks) / (last - first), 1) if name == "backlog" else None,
        "completes_carrying_a_lease": int(sum(ev.get("rides", 0) for ev in tasks)),
        "calls": kinds,
        "calls_per_task": round(sum(v for k, v in kinds.items() if k != "settings") / len(tasks), 2),
    }


def print_round(result: dict[str, Any]) -> None:
    print(
        f"\n== {result['round']}: {result['tasks']} tasks; times in ms from the task's {result['reference']}"
    )
    print(f"{'event (median task)':<28}{'t ms':>9}{'+ms':>9}")
    previous = None
    for row in result["median_task"]:
        step = "" if previous is None else f"{row['ms'] - previous:+.2f}"
        print(f"{row['event']:<28}{row['ms']:>9.2f}{step:>9}")
        previous = row["ms"]
    print(f"\n{'gap (median over tasks)':<40}{'ms':>9}")
    for label, value in result["gaps_ms_median"].items():
        print(f"{label:<40}{'n/a' if value is None else f'{value:.2f}':>9}")
    rate = f", {result['tasks_per_s']} tasks/s" if result["tasks_per_s"] else ""
    print(f"wall per task (from {result['reference']} to complete answered): median {result['wall_ms_median']:.2f} "
          f"ms, p90 {result['wall_ms_p90']:.2f} ms{rate}")  # fmt: skip
    print(f"calls: {result['calls']} ({result['calls_per_task']} per task); completes carrying a lease: "
          f"{result['completes_carrying_a_lease']}")  # fmt: skip


# ------------------------------------------------------------------------------------------ databases


@contextlib.contextmanager
def database(kind: str, tmp: Path) -> Iterator[str]:
    """A new Orbit database of ``kind``, migrated; its URL; dropped on exit."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp / 'timeline.db'}"
        cli("migrate", url=url)
        yield url
        return
    if kind == "mariadb":
        with migrated_mariadb("orbit_timeline") as url:
            yield url
        return
    from bench._compare import postgres_databases

    with postgres_databases("timeline") as urls:
        cli("migrate", url=urls["timeline"])
        yield urls["timeline"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server-db", choices=["sqlite", "mariadb", "postgres"], default="sqlite")
    parser.add_argument("--tasks", type=int, default=200, help="tasks of the backlog round (default 200)")
    parser.add_argument("--trickle", type=int, default=40, help="tasks of the trickle round (default 40)")
    parser.add_argument("--worker", choices=["thread", "async"], default="thread")
    parser.add_argument("--retry-safe", action="store_true", help="submit retry-safe tasks (lease-and-start)")
    parser.add_argument(
        "--handler-ms", type=float, default=0.0, help="each handler sleeps this long (default 0)"
    )
    parser.add_argument("--json-file", default=None, help="results file (default bench/results/...; - none)")
    args = parser.parse_args()
    settings = {"server_db": args.server_db, "tasks": args.tasks, "trickle": args.trickle, "worker": args.worker,
                "retry_safe": args.retry_safe, "handler_ms": args.handler_ms,
                "worker settings": "defaults (concurrency 1, report_linger, prefetch, lease_seconds 30, "
                "poll_wait_seconds 2)", "server": "orbit-server serve defaults, one process"}  # fmt: skip
    meta = run_provenance("bench.timeline", settings)
    meta["server_db"] = args.server_db
    tmp = Path(tempfile.mkdtemp(prefix="orbit-timeline-"))
    with database(args.server_db, tmp) as url:
        cli("namespace", "create", NAMESPACE, url=url)
        for queue in ("backlog", "trickle"):
            cli("queue", "create", NAMESPACE, queue, url=url)
        keys = {
            role: cli("api-key", "create", NAMESPACE, "--role", role, url=url) for role in ("submit", "work")
        }
        with orbit_server_processes(url) as servers:
            base = servers[0].base
            rounds = [backlog_round(base, keys, args, "backlog"), trickle_round(base, keys, args, "trickle")]
    meta["loadavg_at_end"] = os.getloadavg()
    print(f"server db {args.server_db}, {args.worker} worker at its defaults, "
          f"{'retry-safe' if args.retry_safe else 'default'} tasks, handler {args.handler_ms} ms; "
          f"commit {meta['commit'][:7]}{' (uncommitted changes)' if meta['uncommitted_changes'] else ''}; "
          f"load {meta['loadavg_at_start']} → {meta['loadavg_at_end']}")  # fmt: skip
    for result in rounds:
        print_round(result)
    figures = _figures(rounds)
    if args.json_file != "-":
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M")
        path = (
            Path(args.json_file)
            if args.json_file
            else RESULTS / f"timeline-{stamp}-{meta['commit'][:7]}.json"
        )
        path.write_text(json.dumps({"meta": meta, "figures": figures, "rounds": rounds}, indent=1) + "\n")
        print(f"\nwrote {path}", file=sys.stderr)


def _figures(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures the docs' table shows (``docs/_hooks/bench_results.py``): per round, the wall time,
    the rate and each gap's median."""
    figures: list[dict[str, Any]] = []
    for result in rounds:
        section = result["round"]
        figures.append({"section": section, "name": f"{section}: wall per task, median",
                        "value": result["wall_ms_median"], "unit": "ms",
                        "note": f"from the task's {result['reference']} to its complete answered"})  # fmt: skip
        if result["tasks_per_s"]:
            figures.append({"section": section, "name": f"{section}: tasks/s", "value": result["tasks_per_s"],
                            "unit": "tasks/s"})  # fmt: skip
        figures.append({"section": section, "name": f"{section}: HTTP calls per task",
                        "value": result["calls_per_task"], "unit": "calls"})  # fmt: skip
        for label, value in result["gaps_ms_median"].items():
            if value is not None:
                figures.append(
                    {"section": section, "name": f"{section}: {label}", "value": value, "unit": "ms"}
                )
    return figures


if __name__ == "__main__":
    main()
