"""Each worker call's server cost as a ratio to the floor: a minimal route doing a start's writes.

    python -m bench.call_floor [--calls 300] [--rounds 3] [--json-file PATH|-] [--ab-env NAME=VALUE ...]

Issue 28's yardstick. One ``orbit-server serve`` process and the floor (:mod:`bench._floor_app`: a
bare FastAPI route under the same uvicorn that updates a task and its attempt by primary key,
inserts one event and commits) run on one fresh MariaDB database, each as its own MariaDB user, so
that MariaDB's per-user statistics (``userstat``, switched on for the run and restored after) count
each side's commands (``SELECT`` + ``UPDATE`` + other commands, ``COMMIT`` included) and its CPU
time. Every call is sent ``--calls`` times one after the other (concurrency 1) from this process,
on leased tasks prepared beforehand (their preparation is not counted): single ``start``,
``heartbeat`` and ``complete``; the same as one-item batches (``POST .../attempts/start`` with one
item) and two-item batches (what a ``Worker`` at concurrency 1 sends most: its next task runs while
the report of the last one lingers; figures per call, no target); a lease with one grant, one with eight
(what a worker leasing in bulk asks for; per call, no target) and an empty lease (``wait_seconds`` 0); ``/healthz`` beside a bare route. For each, the server process's CPU per call
(``/proc``) and its ratio to the floor's CPU per call in the same round; ``--rounds`` rounds, the
floor first in odd rounds and last in even ones; the medians. Targets (issue 28): start, complete
and heartbeat ≤ 1.5× the floor and ≤ 4 commands with the ``COMMIT``; a lease with one grant ≤ 2×;
an empty lease ≤ 1× and no write. Background loops of the server (sweep, scheduler, flows,
metrics sampling) are off, as they are not part of any call.

``--ab-env ORBIT_FAST_LANE=false`` (for example) runs a second ``orbit-server serve`` on the same
database with that environment, measured in the same rounds (the two in alternating order): its calls
are reported with the setting in brackets, each with its ratio to the floor and to the first server's
same call (the median of the per-round ratios), an A/B comparison paired against the machine's load.

Writes its figures with date, commit, machine and load averages to ``bench/results/floor-*.json``
unless ``--json-file -``. Needs MariaDB at ``ORBIT_TEST_MYSQL_URL`` with a user that may create
users and set ``userstat`` (root on this machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, cpu_seconds, orbit_server_processes, run_provenance

RESULTS = Path(__file__).resolve().parent / "results"
NS = "floor"
#: (call, target ratio to the floor's CPU, most commands) — ``None``: no target.
CALLS: list[tuple[str, float | None, int | None]] = [
    ("start", 1.5, 4), ("heartbeat", 1.5, 4), ("complete", 1.5, 4),
    ("start, one-item batch", 1.5, 4), ("complete, one-item batch", 1.5, 4),
    ("start, two-item batch", None, None), ("complete, two-item batch", None, None),
    ("lease, one grant", 2.0, None), ("lease, eight grants", None, None), ("empty lease", 1.0, None),
    ("/healthz", None, 0),
]  # fmt: skip
_USERSTAT = "SELECT SELECT_COMMANDS + UPDATE_COMMANDS + OTHER_COMMANDS, CPU_TIME FROM information_schema.USER_STATISTICS WHERE USER = :u"


class Counters:
    """MariaDB's per-user commands and CPU seconds, read through ``admin``."""

    def __init__(self, admin: sa.Engine) -> None:
        self.admin = admin

    def read(self, user: str) -> tuple[int, float]:
        with self.admin.connect() as conn:
            row = conn.execute(sa.text(_USERSTAT), {"u": user}).first()
        return (int(row[0]), float(row[1])) if row else (0, 0.0)


def _measure(counters: Counters, user: str, pid: int, calls: list[Callable[[], None]]) -> dict[str, float]:
    """Run ``calls`` one after the other; the server's CPU, MariaDB's commands and CPU, and the wall
    time, each per call."""
    commands, db_cpu = counters.read(user)
    cpu, started = cpu_seconds(pid), time.perf_counter()
    for call in calls:
        call()
    wall, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    commands_after, db_cpu_after = counters.read(user)
    n = len(calls)
    return {
        "server_cpu_ms": cpu / n * 1000,
        "commands": (commands_after - commands) / n,
        "db_cpu_ms": (db_cpu_after - db_cpu) / n * 1000,
        "wall_ms": wall / n * 1000,
    }


@contextlib.contextmanager
def _database(admin: sa.Engine) -> Iterator[tuple[str, dict[str, str]]]:
    """A fresh database and two MariaDB users for it (``orbit``, ``floor``); dropped after."""
    name = f"bench_floor_{uuid.uuid4().hex[:8]}"
    users = {role: f"bf_{role}_{uuid.uuid4().hex[:6]}" for role in ("orbit", "floor")}
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
        for user in users.values():
            conn.exec_driver_sql(f"CREATE USER '{user}'@'%%'")
            conn.exec_driver_sql(f"GRANT ALL ON `{name}`.* TO '{user}'@'%%'")
    try:
        yield name, users
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
            for user in users.values():
                conn.exec_driver_sql(f"DROP USER IF EXISTS '{user}'@'%%'")


@contextlib.contextmanager
def _floor_process(url: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "bench._floor_app", url, str(port)])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/floor/ping").status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the floor app did not start")
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Orbit:
    """The Orbit side: its HTTP clients and task preparation."""

    def __init__(self, base: str, keys: dict[str, str], url: str, prefix: str = "") -> None:
        self.work = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {keys['work']}"}, timeout=60
        )
        self.submit = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {keys['submit']}"}, timeout=60
        )
        self.url = url
        self.prefix = prefix
        self.queues = 0
        #: Whether batch items name their task, as a Worker's do against a server that takes it (``item_task_ids``).
        self.names_tasks = bool(self.work.get("/v1/settings").json().get("item_task_ids"))

    def queue(self) -> str:
        self.queues += 1
        name = f"{self.prefix}q{self.queues}"
        cli("queue", "create", NS, name, url=self.url)
        return name

    def submitted(self, n: int) -> str:
        queue = self.queue()
        for first in range(0, n, 100):
            items = [
                {"idempotency_key": uuid.uuid4().hex, "queue": queue, "handler": "h", "params": {"n": i}}
                for i in range(first, min(n, first + 100))
            ]
            response = self.submit.post(f"/v1/namespaces/{NS}/tasks/batch", json={"items": items})
            response.raise_for_status()
        return queue

    def lease(self, queue: str, n: int) -> list[dict[str, Any]]:
        body = {"worker_id": "bench", "max_tasks": n, "lease_seconds": 600, "wait_seconds": 0}
        response = self.work.post(f"/v1/namespaces/{NS}/queues/{queue}/leases", json=body)
        response.raise_for_status()
        return list(response.json())

    def leased(self, n: int) -> list[dict[str, Any]]:
        queue = self.submitted(n)
        grants: list[dict[str, Any]] = []
        while len(grants) < n:
            grants += self.lease(queue, min(100, n - len(grants)))
        return grants

    def post(self, path: str, body: dict[str, Any]) -> None:
        response = self.work.post(f"/v1/namespaces/{NS}{path}", json=body)
        if response.status_code != 200:
            raise SystemExit(f"{path}: {response.status_code} {response.text}")


def _attempt(grant: dict[str, Any], orbit: Orbit | None = None, **body: Any) -> dict[str, Any]:
    """A batch item for ``grant``; naming its task when ``orbit``'s server takes it (as a ``Worker`` does)."""
    named = {"task_id": grant["task"]["id"]} if orbit is not None and orbit.names_tasks else {}
    return {
        "attempt_id": grant["attempt"]["id"],
        "lease_token": grant["attempt"]["lease_token"],
        **named,
        **body,
    }


def _orbit_round(
    orbit: Orbit, counters: Counters, user: str, pid: int, n: int
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}

    def single(action: str, grant: dict[str, Any], **body: Any) -> Callable[[], None]:
        path = f"/attempts/{grant['attempt']['id']}/{action}"
        return lambda: orbit.post(path, {"lease_token": grant["attempt"]["lease_token"], **body})

    def batch(action: str, *grants: dict[str, Any], **body: Any) -> Callable[[], None]:
        return lambda: orbit.post(
            f"/attempts/{action}", {"items": [_attempt(g, orbit, **body) for g in grants]}
        )

    grants = orbit.leased(n)
    out["start"] = _measure(counters, user, pid, [single("start", g) for g in grants])
    out["heartbeat"] = _measure(
        counters, user, pid, [single("heartbeat", g, lease_seconds=600) for g in grants]
    )
    out["complete"] = _measure(
        counters, user, pid, [single("complete", g, result={"ok": True}) for g in grants]
    )
    grants = orbit.leased(n)
    out["start, one-item batch"] = _measure(counters, user, pid, [batch("start", g) for g in grants])
    out["complete, one-item batch"] = _measure(
        counters, user, pid, [batch("complete", g, result={"ok": True}) for g in grants]
    )
    # What a Worker at concurrency 1 sends most (its next task runs while a report lingers): a call of two.
    grants = orbit.leased(2 * n)
    pairs = list(zip(grants[::2], grants[1::2], strict=True))
    out["start, two-item batch"] = _measure(counters, user, pid, [batch("start", *p) for p in pairs])
    out["complete, two-item batch"] = _measure(
        counters, user, pid, [batch("complete", *p, result={"ok": True}) for p in pairs]
    )
    queue = orbit.submitted(n)
    lease_one = lambda: None if orbit.lease(queue, 1) else sys.exit("a lease granted nothing")  # noqa: E731
    out["lease, one grant"] = _measure(counters, user, pid, [lease_one] * n)
    queue = orbit.submitted(8 * n)

    def lease_eight() -> None:
        if len(orbit.lease(queue, 8)) != 8:
            sys.exit("a lease granted fewer than 8")

    out["lease, eight grants"] = _measure(counters, user, pid, [lease_eight] * n)
    empty = orbit.queue()
    lease_none = lambda: sys.exit("an empty queue granted a task") if orbit.lease(empty, 1) else None  # noqa: E731
    out["empty lease"] = _measure(counters, user, pid, [lease_none] * n)
    health = lambda: orbit.work.get("/healthz").raise_for_status() and None  # noqa: E731
    out["/healthz"] = _measure(counters, user, pid, [health] * n)
    return out


def _floor_round(
    floor: httpx.Client, grants: list[dict[str, Any]], counters: Counters, user: str, pid: int
) -> dict[str, dict[str, float]]:
    def call(grant: dict[str, Any]) -> Callable[[], None]:
        path = f"/floor/{grant['task']['id']}/{grant['attempt']['id']}"
        return lambda: floor.post(path).raise_for_status() and None

    return {
        "floor": _measure(counters, user, pid, [call(g) for g in grants]),
        "bare route": _measure(
            counters, user, pid, [lambda: floor.get("/floor/ping").raise_for_status() and None] * len(grants)
        ),
    }


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    """When, on what code and machine load this run was made, and with which settings."""
    return run_provenance(
        "bench.call_floor",
        {
            "calls": args.calls,
            "rounds": args.rounds,
            "orbit server": "orbit-server serve defaults, background loops off (sweep, scheduler, flow, metrics "
            "sampling intervals 0), MariaDB on this machine, PyMySQL",
            "floor": "bench._floor_app: FastAPI sync route, same uvicorn options, SQLAlchemy text statements, PyMySQL",
            **({"second server's environment": args.ab_env} if args.ab_env else {}),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300, help="calls of each kind per round (default 300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--json-file", default=None, help="where to write the figures ('-': nowhere)")
    parser.add_argument(
        "--ab-env", action="append", default=[], metavar="NAME=VALUE",
        help="also measure a second server with this environment variable (repeatable), paired in the same "
        "rounds (e.g. ORBIT_FAST_LANE=false); its calls are reported with the variables in brackets",
    )  # fmt: skip
    args = parser.parse_args()
    ab_env = dict(item.split("=", 1) for item in args.ab_env)
    suffix = f" [{' '.join(args.ab_env)}]"
    meta = provenance(args)
    admin = sa.create_engine(MYSQL_SERVER)
    with admin.connect() as conn:
        userstat_was = conn.exec_driver_sql("SELECT @@GLOBAL.userstat").scalar_one()
        conn.exec_driver_sql("SET GLOBAL userstat = 1")
    counters = Counters(admin)
    base_url = sa.make_url(MYSQL_SERVER)
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        with _database(admin) as (name, users):
            url = {role: base_url.set(username=user, password=None, database=name).render_as_string(False)
                   for role, user in users.items()}  # fmt: skip
            cli("migrate", url=url["orbit"])
            cli("namespace", "create", NS, url=url["orbit"])
            keys = {
                role: cli("api-key", "create", NS, "--role", role, url=url["orbit"])
                for role in ("submit", "work")
            }
            quiet = {
                f"ORBIT_{loop}_INTERVAL_SECONDS": "0"
                for loop in ("SWEEP", "SCHEDULER", "FLOW", "METRICS_SAMPLE")
            }
            with (
                orbit_server_processes(url["orbit"], env=quiet) as [server],
                orbit_server_processes(
                    url["orbit"], count=1 if ab_env else 0, env={**quiet, **ab_env}
                ) as other,
                _floor_process(url["floor"]) as (floor_base, floor_proc),
                httpx.Client(base_url=floor_base, timeout=60) as floor,
            ):
                sides = [(Orbit(server.base, keys, url["orbit"]), server.proc.pid, "")]
                sides += [(Orbit(s.base, keys, url["orbit"], prefix="b"), s.proc.pid, suffix) for s in other]
                for orbit, _, _ in sides:
                    orbit.leased(20)  # warm-up: the key cache, the first statements, the sightings
                orbit = sides[0][0]
                for round_ in range(1, args.rounds + 1):
                    floor_grants = orbit.leased(args.calls)
                    figures: dict[str, dict[str, float]] = {}
                    if round_ % 2:
                        figures |= _floor_round(floor, floor_grants, counters, users["floor"], floor_proc.pid)
                    for side, pid, name in sides if round_ % 2 else sides[::-1]:
                        measured = _orbit_round(side, counters, users["orbit"], pid, args.calls)
                        figures |= {kind + name: figure for kind, figure in measured.items()}
                    if not round_ % 2:
                        figures |= _floor_round(floor, floor_grants, counters, users["floor"], floor_proc.pid)
                    rounds.append(figures)
                    print(f"round {round_}: floor {figures['floor']['server_cpu_ms']:.2f} ms/call, "
                          f"start {figures['start']['server_cpu_ms']:.2f}", file=sys.stderr)  # fmt: skip
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"SET GLOBAL userstat = {int(userstat_was)}")
    report = _report(rounds, suffix if ab_env else None)
    _print(report, meta)
    if args.json_file != "-":
        path = (
            Path(args.json_file)
            if args.json_file
            else RESULTS / (f"floor-{datetime.now(UTC).strftime('%Y-%m-%dT%H%M')}-{meta['commit'][:7]}.json")
        )
        meta["loadavg_at_end"] = os.getloadavg()
        path.write_text(json.dumps({"meta": meta, "figures": report}, indent=2) + "\n")
        print(f"wrote {path}")


def _report(
    rounds: list[dict[str, dict[str, float]]], suffix: str | None = None
) -> dict[str, dict[str, Any]]:
    """Medians over the rounds; each call's ratio is the median of its per-round ratios to the floor
    (``/healthz``: to the bare route). With ``suffix`` (``--ab-env``), the second server's calls too,
    each also as the median of its per-round ratios to the first server's same call."""
    out: dict[str, dict[str, Any]] = {}
    calls = [call for call, _, _ in CALLS]
    for kind in ["floor", "bare route", *calls, *(call + suffix for call in calls if suffix)]:
        values = [r[kind] for r in rounds]
        figure: dict[str, Any] = {
            key: round(statistics.median(v[key] for v in values), 3) for key in values[0]
        }
        call = kind.removesuffix(suffix) if suffix else kind
        base = "bare route" if call == "/healthz" else "floor"
        if kind not in ("floor", "bare route"):
            ratios = [r[kind]["server_cpu_ms"] / r[base]["server_cpu_ms"] for r in rounds]
            figure["cpu_ratio_to_" + base.replace(" ", "_")] = round(statistics.median(ratios), 2)
            target = next((t, c) for name, t, c in CALLS if name == call)
            figure["target_cpu_ratio"], figure["target_commands"] = target
            if call != kind:
                paired = [r[kind]["server_cpu_ms"] / r[call]["server_cpu_ms"] for r in rounds]
                figure["cpu_ratio_to_first_server"] = round(statistics.median(paired), 2)
        out[kind] = figure
    return out


def _print(report: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    print(
        f"\nbench.call_floor at {meta['commit'][:7]}, {meta['date']}, load {meta['loadavg_at_start'][0]:.1f}"
    )
    width = max(28, *(len(kind) for kind in report))
    paired = any("cpu_ratio_to_first_server" in f for f in report.values())
    print(
        f"{'call':{width}} {'server CPU ms':>13} {'× floor':>8} {'target':>7} {'commands':>9} {'MariaDB CPU ms':>15} "
        f"{'wall ms':>8}" + (f" {'× first server':>15}" if paired else "")
    )
    for kind, f in report.items():
        ratio = f.get("cpu_ratio_to_floor", f.get("cpu_ratio_to_bare_route"))
        target = f.get("target_cpu_ratio")
        first = f.get("cpu_ratio_to_first_server")
        print(
            f"{kind:{width}} {f['server_cpu_ms']:13.2f} {'' if ratio is None else f'{ratio:.2f}×':>8} "
            f"{'' if target is None else f'≤{target}×':>7} {f['commands']:9.1f} {f['db_cpu_ms']:15.2f} {f['wall_ms']:8.2f}"
            + (f" {'' if first is None else f'{first:.2f}×':>15}" if paired else "")
        )


if __name__ == "__main__":
    main()
