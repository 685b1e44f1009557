"""``python -m bench.chaos``: the chaos run's command line (:mod:`bench.chaos` says what it does)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .postgres import remove_linked
from .run import Options, console, run
from .summary import evidence, results_file, show


def main(argv: list[str] | None = None) -> int:
    from . import __doc__ as doc

    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--orders", type=int, default=10_000, help="orders to place (default 10000)")
    parser.add_argument("--faults", type=int, default=500, help="faults to inject (default 500)")
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the fault schedule and the orders (default 1)"
    )
    parser.add_argument("--db-crashes", type=int, default=None,
                        help="crashes of each database among the faults (default: faults/50, at least 1)")  # fmt: skip
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=None, help="Orbit servers (default 2; 3 on a cluster)")
    parser.add_argument("--cluster", choices=["galera"], default=None,
                        help="both databases on one private 3-node MariaDB Galera cluster, with node faults")  # fmt: skip
    parser.add_argument("--server-db", choices=["mariadb", "postgres"], default="mariadb",
                        help="the Orbit server's database: a private MariaDB (default) or a private PostgreSQL "
                             "(initdb into a temporary directory; its postmaster SIGKILLed among the faults)")  # fmt: skip
    parser.add_argument("--no-skip-locked", action="store_true",
                        help="claims lock nothing (test-only ORBIT_TEST_CLAIMS_WITHOUT_LOCKS): the conditional updates alone")  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=900.0, help="seconds to wait for the drain")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (datadirs, logs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--json-file", help="also write the run's figures, with date, commit, command and load "
                                            "averages, to this file (bench/results/chaos-*.json: the docs quote it)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.orders < 1 or args.faults < 0:
        parser.error("--orders must be at least 1 and --faults at least 0")
    if args.json:
        console.quiet = True
    if args.cluster and args.server_db != "mariadb":
        parser.error("--cluster galera puts both databases on the cluster: leave out --server-db")

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # run() then stops every process it started

    signal.signal(signal.SIGTERM, interrupted)
    started, load = time.time(), list(os.getloadavg())
    crashes = args.db_crashes if args.db_crashes is not None else max(1, args.faults // 50)
    root = Path(tempfile.mkdtemp(prefix="orbit-chaos-"))
    servers = args.servers or (3 if args.cluster else 2)
    opts = Options(args.orders, args.faults, args.seed, crashes if args.faults else 0, args.relays, args.workers,
                   servers, args.no_skip_locked, args.drain_timeout, args.keep, root, args.cluster,
                   server_db=args.server_db)  # fmt: skip
    summary, _ = run(opts)
    if summary["violations"]:
        console.print(evidence(root, summary["violations"]), markup=False, highlight=False)
    if summary["violations"] or opts.keep:
        console.log(f"logs and datadirs kept under {root}")
    else:
        remove_linked(root)  # a private PostgreSQL lives outside the run directory
        shutil.rmtree(root, ignore_errors=True)
    if args.json_file:
        results_file(Path(args.json_file), summary, started, load, argv if argv is not None else sys.argv[1:])
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        show(summary)
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
