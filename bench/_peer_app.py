"""The peer of ``bench.compare``: a procrastinate app with one no-op task, and its worker process.

    BENCH_PEER_CONNINFO="host=127.0.0.1 user=postgres dbname=..." python -m bench._peer_app [--wait]

Runs one procrastinate worker (concurrency ``BENCH_PEER_CONCURRENCY``, default 1; the library's
defaults otherwise) on queue ``bench``;
without ``--wait`` it exits once the queue is empty. ``BENCH_PEER_POOL`` set: the connector's pool
holds that many connections (``min_size`` = ``max_size``; procrastinate's "Limit the number of opened
connections" how-to: a worker uses up to the pool's ``max_size`` connections, plus one for
LISTEN/NOTIFY), instead of psycopg_pool's default of 4. ``BENCH_STARTUP_CPU_FILE`` set: it writes there
the CPU seconds it used before its worker loop (as ``bench.worker_process`` does). Needs the ``bench`` extra.
"""

from __future__ import annotations

import os
import sys
import time

import procrastinate

_POOL = {"min_size": int(os.environ["BENCH_PEER_POOL"])} if os.environ.get("BENCH_PEER_POOL") else {}
if _POOL:
    _POOL["max_size"] = _POOL["min_size"]
app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("BENCH_PEER_CONNINFO", ""), **_POOL)
)


@app.task(name="bench.noop", queue="bench")
async def noop(n: int) -> None:
    """Does nothing: the benchmark measures the queue, not the work. A coroutine, the peer's own kind of task:
    its worker runs a plain function through a thread hop, which cost it 5-10% of its jobs/s here."""
    del n


def main() -> None:
    concurrency = int(os.environ.get("BENCH_PEER_CONCURRENCY", "1"))
    # as bench.worker_process (STARTUP_CPU_ENV, not imported: it would import Orbit's client into the peer)
    if os.environ.get("BENCH_STARTUP_CPU_FILE"):
        with open(os.environ["BENCH_STARTUP_CPU_FILE"], "w") as out:
            out.write(repr(time.process_time()))
    app.run_worker(queues=["bench"], concurrency=concurrency, wait="--wait" in sys.argv[1:])


if __name__ == "__main__":
    main()
