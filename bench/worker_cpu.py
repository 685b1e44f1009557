"""The worker process's own CPU per task, and tasks/s, draining no-op tasks from a real ``orbit-server``.

    python -m bench.worker_cpu [--server orbit|canned] [--database mariadb|sqlite] [--tasks 1000]
                               [--rounds 3] [--concurrency 1 4] [--ab-pythonpath DIR] [--together]
                               [--py-spy DIR]

One ``orbit-server serve`` process (this checkout's) on a new database (MariaDB at
``ORBIT_TEST_MYSQL_URL``, dropped at the end; or SQLite in a temporary directory). Each drain submits
``--tasks`` tasks to a queue of its own (not timed), then starts one worker process (``Worker`` at its
defaults, a no-op handler, ``concurrency`` as given) that measures itself: its CPU (``time.process_time()``,
every thread) and wall time from its first handler call to its ``--tasks``-th, per task; the server's CPU
per task over the same drain is read from ``/proc`` by this process. Start-up and import are not counted.

``--server canned`` puts ``bench/_canned_server.py`` in the server's place: an asyncio fixture that grants
tasks forever and answers every report at once, so the worker's own CPU is measured with no server or
database share in the machine's load (its tasks/s are the worker's ceiling, not Orbit's). With
``--together`` the two sides drain at the same time, each from a canned server of its own: both meet the
same load at every instant (the paired ratio is then far steadier on a shared machine). Against
``orbit-server`` ``--together`` drains both sides' queues from the one server at once (its CPU per task is
then the two drains' mean, and each side's tasks/s is with the other draining beside it).

``--ab-pythonpath DIR`` compares two versions of the client in one run (a paired measurement on a
noisy machine): side A's worker process imports ``orbit_client`` from ``DIR`` first (e.g.
``git archive BASE orbit_client | tar -x -C DIR``), side B's from this checkout; the server is this
checkout's for both. Each round drains once per side and concurrency, alternating which side goes
first, and B / A is the median over rounds of the per-round ratios. ``--py-spy DIR`` records each
drain's worker under ``py-spy record --gil --format raw`` into ``DIR`` (for profiles, not figures:
the sampler costs CPU of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, cpu_seconds, orbit_server_processes
from bench.workers import submit_tasks

#: The worker process: run by path, so that side A's ``orbit_client`` comes first on its path.
_WORKER = Path(__file__).resolve().parent / "_cpu_worker.py"


def drain(base: str, server_pid: int, key: str, queue: str, tasks: int, concurrency: int,
          pythonpath: str, spy: Path | None) -> dict[str, float]:  # fmt: skip
    """One worker process drains ``tasks`` tasks already submitted to ``queue``: its figures."""
    command = [sys.executable, str(_WORKER), base, key, "bench", queue, str(tasks), str(concurrency)]
    if spy is not None:
        command = [
            str(Path(sys.executable).with_name("py-spy")),
            "record",
            "--gil",
            "-r",
            "500",
            "--format",
            "raw",
            "-o",
            str(spy),
            "--",
            *command,
        ]
    before = cpu_seconds(server_pid)
    done = subprocess.run(
        command, env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True, text=True, timeout=900
    )
    server = cpu_seconds(server_pid) - before
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({done.returncode}): {done.stderr[-2000:]}")
    out: dict[str, float] = json.loads(
        next(line for line in done.stdout.splitlines() if line.startswith("{"))
    )
    out["server_cpu_ms"] = server / tasks * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", choices=["orbit", "canned"], default="orbit")
    parser.add_argument("--database", choices=["mariadb", "sqlite"], default="mariadb")
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ab-pythonpath", metavar="DIR", help="side A's orbit_client (B: this checkout)")
    parser.add_argument("--together", action="store_true", help="run the two sides' drains at once")
    parser.add_argument("--py-spy", metavar="DIR", help="record each drain's worker with py-spy into DIR")
    args = parser.parse_args()

    here = str(Path(__file__).resolve().parent.parent)
    sides = {"B": here}
    if args.ab_pythonpath:
        sides = {"A": f"{Path(args.ab_pythonpath).resolve()}{os.pathsep}{here}", "B": here}
    spy = Path(args.py_spy) if args.py_spy else None
    if spy is not None:
        spy.mkdir(parents=True, exist_ok=True)

    if args.server == "canned":
        run_canned(args, sides, spy)
        return
    admin = None
    if args.database == "mariadb":
        name = f"orbit_wcpu_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        url = sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
        cli("migrate", url=url)
    else:
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='orbit-bench-')) / 'bench.db'}"
        cli("migrate", url=url)
    cli("namespace", "create", "bench", url=url)
    keys = {role: cli("api-key", "create", "bench", "--role", role, url=url) for role in ("submit", "work")}
    print(f"load at start {os.getloadavg()}", file=sys.stderr)
    rounds: list[dict[str, Any]] = []
    try:
        with orbit_server_processes(url) as servers:
            server = servers[0]
            for r in range(args.rounds):
                for c in args.concurrency:
                    order = list(sides) if r % 2 == 0 else list(reversed(sides))
                    entry: dict[str, Any] = {"round": r, "concurrency": c, "load": os.getloadavg()[0]}
                    for side in order:
                        cli("queue", "create", "bench", f"q-{side}-{c}-{r}", url=url)
                        submit_tasks(server.base, keys["submit"], f"q-{side}-{c}-{r}", args.tasks)

                    def one(side: str, c: int = c, r: int = r) -> dict[str, float]:
                        profile = spy / f"{side}-c{c}-r{r}.txt" if spy is not None else None
                        return drain(server.base, server.proc.pid, keys["work"], f"q-{side}-{c}-{r}", args.tasks,
                                     c, sides[side], profile)  # fmt: skip

                    if args.together:  # the server's CPU then counts both drains: each gets half
                        with ThreadPoolExecutor(len(order)) as pool:
                            entry.update(zip(order, pool.map(one, order), strict=True))
                        for side in order:
                            entry[side]["server_cpu_ms"] /= len(order)
                    else:
                        for side in order:
                            entry[side] = one(side)
                    rounds.append(entry)
                    print(json.dumps(entry), file=sys.stderr)
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
            admin.dispose()
    print(f"load at end {os.getloadavg()}", file=sys.stderr)
    summary(args, sides, rounds, ("worker_cpu_ms", "tasks_per_s", "server_cpu_ms"))


def run_canned(args: argparse.Namespace, sides: dict[str, str], spy: Path | None) -> None:
    """The rounds against ``bench/_canned_server.py``: one per side, kept for the whole run. With
    ``--together`` the two sides' drains of a round run at the same time (each on its own canned
    server), so that both meet the same load at every instant, not only in the same minute."""
    servers = {
        side: subprocess.Popen(
            [sys.executable, str(_WORKER.with_name("_canned_server.py"))], stdout=subprocess.PIPE, text=True
        )
        for side in sides
    }
    try:
        bases = {}
        for side, canned in servers.items():
            assert canned.stdout is not None
            bases[side] = f"http://127.0.0.1:{int(canned.stdout.readline())}"
        print(f"load at start {os.getloadavg()}", file=sys.stderr)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for c in args.concurrency:
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                entry: dict[str, Any] = {"round": r, "concurrency": c, "load": os.getloadavg()[0]}

                def one(side: str, c: int = c, r: int = r) -> dict[str, float]:
                    profile = spy / f"{side}-c{c}-r{r}.txt" if spy is not None else None
                    return drain(
                        bases[side], servers[side].pid, "key", "q", args.tasks, c, sides[side], profile
                    )

                if args.together:
                    with ThreadPoolExecutor(len(order)) as pool:
                        entry.update(zip(order, pool.map(one, order), strict=True))
                else:
                    for side in order:
                        entry[side] = one(side)
                rounds.append(entry)
                print(json.dumps(entry), file=sys.stderr)
    finally:
        for canned in servers.values():
            canned.terminate()
            canned.wait(timeout=30)
    print(f"load at end {os.getloadavg()}", file=sys.stderr)
    summary(args, sides, rounds, ("worker_cpu_ms", "tasks_per_s"))


def summary(args: argparse.Namespace, sides: dict[str, str], rounds: list[dict[str, Any]],
            figures: tuple[str, ...]) -> None:  # fmt: skip
    """Each figure's median per side and, paired, the median and the rounds of B / A."""
    print(f"server={args.server} tasks/drain={args.tasks} rounds={args.rounds}")
    for c in args.concurrency:
        mine = [e for e in rounds if e["concurrency"] == c]
        for figure in figures:
            medians = "  ".join(f"{s}={statistics.median(e[s][figure] for e in mine):8.3f}" for s in sides)
            line = f"c{c:<3} {figure:<15} {medians}"
            if "A" in sides:
                ratios = [e["B"][figure] / e["A"][figure] for e in mine]
                line += f"  B/A median {statistics.median(ratios):.3f} rounds {' '.join(f'{x:.3f}' for x in ratios)}"
            print(line)


if __name__ == "__main__":
    main()
