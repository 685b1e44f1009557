"""The peer of ``bench.compare``: a procrastinate app with one no-op task, and its worker process.

    BENCH_PEER_CONNINFO="host=127.0.0.1 user=postgres dbname=..." python -m bench._peer_app [--wait]

Runs one procrastinate worker (concurrency ``BENCH_PEER_CONCURRENCY``, default 1; the library's
defaults otherwise) on queue ``bench``;
without ``--wait`` it exits once the queue is empty. Needs the ``bench`` extra.
"""

from __future__ import annotations

import os
import sys

import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("BENCH_PEER_CONNINFO", ""))
)


@app.task(name="bench.noop", queue="bench")
def noop(n: int) -> None:
    """Does nothing: the benchmark measures the queue, not the work."""
    del n


def main() -> None:
    concurrency = int(os.environ.get("BENCH_PEER_CONCURRENCY", "1"))
    app.run_worker(queues=["bench"], concurrency=concurrency, wait="--wait" in sys.argv[1:])


if __name__ == "__main__":
    main()
