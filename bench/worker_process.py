"""The worker process of ``bench.workers``: an echo handler.

python -m bench.worker_process URL KEY NS QUEUE CONCURRENCY [REPORT_LINGER|none]
"""

from __future__ import annotations

import sys
from typing import Any

from orbit_client import OrbitClient, TaskContext, Worker


def echo(ctx: TaskContext) -> Any:
    return {"n": ctx.params["n"], "generation": ctx.generation}


def main() -> None:
    url, key, namespace, queue, concurrency = sys.argv[1:6]
    options: dict[str, Any] = {}
    if len(sys.argv) > 6:  # else the worker's default
        options["report_linger"] = None if sys.argv[6] == "none" else float(sys.argv[6])
    with OrbitClient(url, api_key=key, timeout=60) as client:
        Worker(
            client, namespace, queue, {"bench.echo": echo}, concurrency=int(concurrency), lease_seconds=30,
            poll_wait_seconds=1, **options,
        ).run()  # fmt: skip


if __name__ == "__main__":
    main()
