"""The worker process of ``bench.workers``: an echo handler.

python -m bench.worker_process URL KEY NS QUEUE CONCURRENCY [REPORT_LINGER|none]

With ``BENCH_STARTUP_CPU_FILE`` set, it writes there the CPU seconds it used before its worker loop
(imports, set-up), for a benchmark that leaves them out of the worker's CPU per task.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from orbit_client import OrbitClient, TaskContext, Worker

#: Where a benchmark wants the CPU seconds this process used before its worker loop (imports, set-up),
#: which it leaves out of the worker's CPU per task; the peer's worker (``bench._peer_app``) does the same.
STARTUP_CPU_ENV = "BENCH_STARTUP_CPU_FILE"


def startup_cpu(path: str | None) -> None:
    """Write this process's CPU seconds so far (every thread) to ``path`` (``None``: nothing)."""
    if path:
        with open(path, "w") as out:
            out.write(repr(time.process_time()))


def echo(ctx: TaskContext) -> Any:
    return {"n": ctx.params["n"], "generation": ctx.generation}


def main() -> None:
    url, key, namespace, queue, concurrency = sys.argv[1:6]
    options: dict[str, Any] = {}
    if len(sys.argv) > 6:  # else the worker's default
        options["report_linger"] = None if sys.argv[6] == "none" else float(sys.argv[6])
    with OrbitClient(url, api_key=key, timeout=60) as client:
        startup_cpu(os.environ.get(STARTUP_CPU_ENV))
        Worker(
            client, namespace, queue, {"bench.echo": echo}, concurrency=int(concurrency), lease_seconds=30,
            poll_wait_seconds=1, **options,
        ).run()  # fmt: skip


if __name__ == "__main__":
    main()
