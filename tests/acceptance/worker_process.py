"""A worker process for the acceptance tests: ``python -m tests.acceptance.worker_process URL KEY NS QUEUE``.

Handlers:

- ``echo``: returns ``{"n": params["n"]}``.
- ``hang_first``: the first attempt (generation 1) never returns; later attempts return their generation.
- ``slow``: sleeps ``params["seconds"]`` and returns ``"slept"``.

Every handler run appends ``<task id> <generation>`` to the ``--journal`` file (if given) and
prints ``started <task id> <generation>`` on stdout, flushed, so a test can wait for it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from typing import Any

from orbit_client import OrbitClient, TaskContext, Worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("key")
    parser.add_argument("namespace")
    parser.add_argument("queue")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--lease-seconds", type=float, default=5.0)
    parser.add_argument("--journal", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    printing = threading.Lock()

    def record(ctx: TaskContext) -> None:
        # One write per line, under a lock: handlers whose starts were confirmed by one batched call
        # print at the same moment, and print() writes the text and the newline separately.
        with printing:
            if args.journal:
                with open(args.journal, "a", encoding="utf-8") as journal:
                    journal.write(f"{ctx.task.id} {ctx.generation}\n")
            sys.stdout.write(f"started {ctx.task.id} {ctx.generation}\n")
            sys.stdout.flush()

    def echo(ctx: TaskContext) -> Any:
        record(ctx)
        return {"n": ctx.params["n"]}

    def hang_first(ctx: TaskContext) -> Any:
        record(ctx)
        if ctx.generation == 1:
            while True:
                time.sleep(1)
        return {"generation": ctx.generation}

    def slow(ctx: TaskContext) -> Any:
        record(ctx)
        time.sleep(ctx.params["seconds"])
        return "slept"

    with OrbitClient(args.url, api_key=args.key, timeout=30) as client:
        worker = Worker(
            client,
            args.namespace,
            args.queue,
            {"echo": echo, "hang_first": hang_first, "slow": slow},
            concurrency=args.concurrency,
            lease_seconds=args.lease_seconds,
            poll_wait_seconds=0.5,
            worker_id=f"proc-{os.getpid()}",
        )
        print("ready", flush=True)
        worker.run()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
