"""The worker process of ``bench.worker_cpu``: a no-op handler; it measures its own CPU and wall time.

python bench/_cpu_worker.py URL KEY NS QUEUE TASKS CONCURRENCY

Run by path (not ``-m``), so that ``orbit_client`` comes from whatever ``PYTHONPATH`` puts first.
Prints one JSON line: ``worker_cpu_ms`` (``time.process_time()``, every thread) and ``tasks_per_s``
from the first handler call to the ``TASKS``-th, per task.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from orbit_client import OrbitClient, TaskContext, Worker


def main() -> None:
    url, key, namespace, queue, tasks, concurrency = sys.argv[1:7]
    total = int(tasks)
    lock = threading.Lock()
    marks: list[tuple[float, float]] = []
    worker: Worker

    def noop(ctx: TaskContext) -> Any:
        with lock:
            marks.append((time.process_time(), time.perf_counter()))
            if len(marks) == total:
                worker.stop()
        return None

    with OrbitClient(url, api_key=key, timeout=60) as client:
        worker = Worker(client, namespace, queue, {"bench.echo": noop}, concurrency=int(concurrency),
                        install_signal_handlers=False)  # fmt: skip
        worker.run()
    (cpu0, wall0), (cpu1, wall1) = marks[0], marks[-1]
    n = len(marks) - 1
    print(json.dumps({"worker_cpu_ms": (cpu1 - cpu0) / n * 1e3, "tasks_per_s": n / (wall1 - wall0)}))


if __name__ == "__main__":
    main()
