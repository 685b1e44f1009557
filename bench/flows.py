"""A 3-step flow end to end, beside the same three steps as plain chained tasks, in one run.

    python -m bench.flows [--n 200] [--concurrency 8] [--rounds 4] [--sqlite] [--json]

One Orbit server process (a new MariaDB database at ``ORBIT_TEST_MYSQL_URL``, dropped at the end;
``--sqlite``: a temporary SQLite file) and one worker process (``--concurrency`` handler threads)
serving both workloads on one queue:

- **flow**: ``--n`` instances of ``bench-3step`` (task ``a`` → task ``b`` → task ``c`` → end), each
  started with ``start_flow`` (8 client threads), until every instance is ``COMPLETED``. The server
  creates each step's task in the transaction that advances the token (invariant 9).
- **chain**: ``--n`` chains of the same three steps as plain tasks: the client submits ``a``; each
  step's handler submits the next with a key derived from the chain's (how a task queue without flows
  chains steps, e.g. procrastinate's jobs deferring the next job), until every ``c`` has succeeded.

Each round runs chain then flow; figures are per round and the median over rounds: instances (or
chains) per second from the first start to the last completion, and the median and p95 latency from
the database's timestamps (start → instance finished; first task created → last task finished). The
ratio flow/chain, per round and the median of the rounds' ratios, is what flows cost over hand-chained
tasks on the same machine (compare ratios: these machines are noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench._compare import mysql_databases
from bench._flow_worker import CHAIN_STEPS, FLOW_STEPS
from bench._support import cli, orbit_server_processes
from orbit_client import OrbitClient, RetryPolicy

NS, QUEUE, FLOW = "bench", "q", "bench-3step"
GRAPH = {
    "start": "a",
    "nodes": {
        "a": {
            "type": "task",
            "queue": QUEUE,
            "handler": FLOW_STEPS[0],
            "params": {"n": "$.input.n"},
            "next": "b",
        },
        "b": {
            "type": "task",
            "queue": QUEUE,
            "handler": FLOW_STEPS[1],
            "params": {"n": "$.input.n"},
            "next": "c",
        },
        "c": {
            "type": "task",
            "queue": QUEUE,
            "handler": FLOW_STEPS[2],
            "params": {"n": "$.input.n"},
            "next": "done",
        },
        "done": {"type": "end"},
    },
}


def _wait_until(check: Callable[[], bool], what: str, timeout: float) -> None:
    """Poll ``check`` (a database count: there is no event to await across processes)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def _in_threads(n: int, threads: int, make: Callable[[OrbitClient, int], None], base: str, key: str) -> None:
    """Call ``make(client, i)`` for i in 0..n-1 from ``threads`` threads, one client each."""
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            with OrbitClient(base, api_key=key, timeout=60, retry=RetryPolicy(max_attempts=5)) as client:
                for i in range(index, n, threads):
                    make(client, i)
        except BaseException as exc:  # reported below, not lost in a thread
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]


def _at(value: Any) -> datetime:
    """A timestamp column read through ``sa.text`` (SQLite hands back text)."""
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_chain(engine: sa.Engine, base: str, key: str, n: int, threads: int) -> dict[str, float]:
    run = f"c{uuid.uuid4().hex[:8]}"
    first, last = CHAIN_STEPS[0], CHAIN_STEPS[-1]
    done = sa.text(
        "SELECT count(*) FROM tasks WHERE handler = :h AND status = 'SUCCEEDED' AND params LIKE :run"
    )
    like = f'%"{run}"%'
    started = time.perf_counter()
    _in_threads(n, threads, lambda client, i: client.submit_task(
        NS, QUEUE, first, {"run": run, "n": i}, idempotency_key=f"{run}-{i}-{first}"), base, key)  # fmt: skip
    with engine.connect() as conn:
        _wait_until(lambda: conn.execute(done, {"h": last, "run": like}).scalar_one() >= n, "the chains", 900)
        elapsed = time.perf_counter() - started
        rows = conn.execute(
            sa.text("SELECT handler, params, created_at, finished_at FROM tasks WHERE params LIKE :run"),
            {"run": like},
        ).all()
    begun: dict[int, Any] = {}
    ended: dict[int, Any] = {}
    for handler, params, created, finished in rows:
        i = (json.loads(params) if isinstance(params, str) else params)["n"]
        if handler == first:
            begun[i] = created
        elif handler == last:
            ended[i] = finished
    latencies = [(_at(ended[i]) - _at(begun[i])).total_seconds() for i in ended if i in begun]
    return {"rate": n / elapsed, "p50": statistics.median(latencies), "p95": _percentile(latencies, 0.95)}


def run_flow(engine: sa.Engine, base: str, key: str, n: int, threads: int) -> dict[str, float]:
    run = f"f{uuid.uuid4().hex[:8]}"
    done = sa.text(
        "SELECT count(*) FROM flow_instances WHERE status = 'COMPLETED' AND idempotency_key LIKE :run"
    )
    like = f"{run}-%"
    started = time.perf_counter()
    _in_threads(n, threads, lambda client, i: client.start_flow(
        NS, FLOW, {"n": i}, idempotency_key=f"{run}-{i}"), base, key)  # fmt: skip
    with engine.connect() as conn:
        _wait_until(lambda: conn.execute(done, {"run": like}).scalar_one() >= n, "the flow instances", 900)
        elapsed = time.perf_counter() - started
        failed = conn.execute(
            sa.text(
                "SELECT count(*) FROM flow_instances WHERE status <> 'COMPLETED' AND idempotency_key LIKE :run"
            ),
            {"run": like},
        ).scalar_one()
        rows = conn.execute(
            sa.text("SELECT created_at, finished_at FROM flow_instances WHERE idempotency_key LIKE :run"),
            {"run": like},
        ).all()
    if failed:
        raise SystemExit(f"{failed} flow instances did not complete")
    latencies = [(_at(finished) - _at(created)).total_seconds() for created, finished in rows]
    return {"rate": n / elapsed, "p50": statistics.median(latencies), "p95": _percentile(latencies, 0.95)}


@contextlib.contextmanager
def _database(sqlite: bool) -> Iterator[str]:
    if not sqlite:
        with mysql_databases("flows") as urls:
            yield urls["flows"]
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield f"sqlite:///{Path(tmp) / 'orbit.db'}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=200, help="instances (and chains) per round (default 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="worker handler threads (default 8)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of chain then flow (default 4)")
    parser.add_argument("--threads", type=int, default=8, help="client threads starting work (default 8)")
    parser.add_argument("--sqlite", action="store_true", help="the server on a temporary SQLite file")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rounds: list[dict[str, dict[str, float]]] = []  # {"chain": ..., "flow": ..., "ratio": ...}
    with _database(args.sqlite) as url:
        cli("migrate", url=url)
        cli("namespace", "create", NS, url=url)
        cli("queue", "create", NS, QUEUE, url=url)
        keys = {role: cli("api-key", "create", NS, "--role", role, url=url) for role in ("submit", "work")}
        engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")  # each poll sees the latest commits
        with orbit_server_processes(url) as [server]:
            with OrbitClient(server.base, api_key=keys["submit"]) as client:
                client.publish_flow(NS, FLOW, GRAPH, description="bench.flows: three task steps")
            worker = subprocess.Popen(
                [sys.executable, "-m", "bench._flow_worker", server.base, keys["work"], keys["submit"], NS, QUEUE,
                 str(args.concurrency)],
                stdout=subprocess.DEVNULL, env=os.environ.copy(),
            )  # fmt: skip
            try:
                for _ in range(args.rounds):
                    chain = run_chain(engine, server.base, keys["submit"], args.n, args.threads)
                    flow = run_flow(engine, server.base, keys["submit"], args.n, args.threads)
                    rounds.append({"chain": chain, "flow": flow})
            finally:
                worker.terminate()
                worker.wait(timeout=60)
        engine.dispose()
    summary = {
        "n": args.n,
        "rounds": rounds,
        "database": "sqlite" if args.sqlite else "mariadb",
        "cpus": os.cpu_count(),
        "median": {
            kind: {m: statistics.median(r[kind][m] for r in rounds) for m in ("rate", "p50", "p95")}
            for kind in ("chain", "flow")
        },
    }
    med = summary["median"]
    # The ratio of each round (chain and flow minutes apart at most), then their median: the machine's
    # load moves between rounds more than between the two halves of one.
    for r in rounds:
        r["ratio"] = {
            "rate": r["flow"]["rate"] / r["chain"]["rate"],
            "p50": r["flow"]["p50"] / r["chain"]["p50"],
        }
    summary["ratio_rate_flow_over_chain"] = statistics.median(r["ratio"]["rate"] for r in rounds)
    summary["ratio_p50_flow_over_chain"] = statistics.median(r["ratio"]["p50"] for r in rounds)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"bench.flows: n={args.n} per round, {args.rounds} rounds, {summary['database']}, "
              f"{args.concurrency} worker threads, {os.cpu_count()} CPUs")  # fmt: skip
        print(f"{'':28}{'per second':>12}{'p50 latency':>14}{'p95 latency':>14}")
        for index, r in enumerate(rounds, 1):
            for kind, label in (("chain", "3 chained tasks"), ("flow", "3-step flow")):
                f = r[kind]
                print(f"round {index}: {label:<18}{f['rate']:>12.1f}{f['p50']:>13.3f}s{f['p95']:>13.3f}s")
            print(f"round {index}: flow / chain {r['ratio']['rate']:>14.2f}×{r['ratio']['p50']:>13.2f}×")
        for kind, label in (("chain", "3 chained tasks"), ("flow", "3-step flow")):
            f = med[kind]
            print(f"median:  {label:<19}{f['rate']:>12.1f}{f['p50']:>13.3f}s{f['p95']:>13.3f}s")
        print(f"ratio flow / chain (median of the rounds' ratios): {summary['ratio_rate_flow_over_chain']:.2f}× "
              f"the rate, {summary['ratio_p50_flow_over_chain']:.2f}× the p50 latency")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
