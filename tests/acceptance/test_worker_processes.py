"""Workers as real processes, killed for real (DESIGN §4; issue: task execution).

- A worker SIGKILLed while it holds tasks: after the lease lapses, the retry-safe task is
  leased again and finished by another worker; the other one stops for review.
- A worker sent SIGTERM finishes the task it is running, then exits 0.
- Four worker processes × 500 tasks on MariaDB: every task SUCCEEDED exactly once, and no task
  ever had two live attempts (checked from ``task_attempts``).
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient, Task
from orbit_server.db.schema import task_attempts, tasks
from tests.conftest import DatabaseFactory
from tests.execution_support import check_attempt_history
from tests.servers import RunningServer, run_server

REPO = Path(__file__).resolve().parents[2]
BACKENDS = [
    "sqlite",
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


class WorkerProcess:
    """``python -m tests.acceptance.worker_process`` with its stdout read line by line."""

    def __init__(
        self, server: RunningServer, namespace: str, key: str, queue_name: str, log: Path, **opts: object
    ):
        args = [
            sys.executable,
            "-m",
            "tests.acceptance.worker_process",
            server.base_url,
            key,
            namespace,
            queue_name,
        ]
        for name, value in opts.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self._stderr = log.open("w")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.log = log

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 30) -> str:
        """The next stdout line starting with ``prefix`` (the worker prints it when it gets there)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, (
                f"no {prefix!r} line from the worker; stderr: {self.log.read_text()[-2000:]}"
            )
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line

    def stop(self, sig: signal.Signals | None = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig`` (``None``: none) and wait for the exit code."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.close()
        return code

    def close(self) -> None:
        """Release the pipes once the process has ended."""
        self._reader.join(timeout=10)  # it ends at EOF, once the process is gone
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(timeout=10)
        worker.close()


def _setup(server: RunningServer) -> tuple[str, dict[str, str], str]:
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    keys = server.add_namespace(namespace, ("work",))
    return namespace, keys, "work"


def _wait(client: OrbitClient, namespace: str, task_id: str, status: str, timeout: float = 30) -> Task:
    """Poll until the task has ``status`` (the sweep happens in the server: no event to await)."""
    deadline = time.monotonic() + timeout
    while True:
        task = client.get_task(namespace, task_id)
        if task.status == status:
            return task
        assert time.monotonic() < deadline, f"task {task_id} stayed {task.status}, expected {status}"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_killed_worker_s_task_is_leased_again_after_its_lease_lapses(
    make_database: DatabaseFactory, kind: str, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    with run_server(make_database(kind), sweep_interval_seconds=0.2) as server:
        namespace, keys, queue_name = _setup(server)
        with OrbitClient(server.base_url, api_key=keys["admin"]) as client:

            def submit(**options: object) -> str:
                return client.submit_task(
                    namespace,
                    queue_name,
                    "hang_first",
                    None,
                    idempotency_key=str(uuid.uuid4()),
                    options=options,
                ).task.id

            safe = submit(retry_safe=True, backoff_base_seconds=0)
            unsafe = submit()
            # 3 s: the two attempts must keep their leases until the kill (with 1 s, a worker process stalled
            # 0.7 s by a loaded machine would lose them before it); the kill then leaves them to lapse.
            first = WorkerProcess(server, namespace, keys["work"], queue_name, tmp_path / "first.log",
                                  concurrency=2, lease_seconds=3)  # fmt: skip
            workers.append(first)
            running = {first.expect("started").split()[1], first.expect("started").split()[1]}
            assert running == {safe, unsafe}
            assert first.stop(signal.SIGKILL) == -signal.SIGKILL

            second = WorkerProcess(server, namespace, keys["work"], queue_name, tmp_path / "second.log",
                                   lease_seconds=5)  # fmt: skip
            workers.append(second)
            assert second.expect("started") == f"started {safe} 2"
            done = _wait(client, namespace, safe, "SUCCEEDED")
            review = _wait(client, namespace, unsafe, "NEEDS_REVIEW")
            assert second.stop() == 0

            assert done.result == {"generation": 2}
            old, new = client.list_attempts(namespace, safe)
            assert (old.status, old.worker_id) == ("EXPIRED", f"proc-{first.proc.pid}")
            assert (new.status, new.worker_id) == ("SUCCEEDED", f"proc-{second.proc.pid}")
            assert review.error["type"] == "outcome_unknown"  # type: ignore[index]
            assert [a.status for a in client.list_attempts(namespace, unsafe)] == ["EXPIRED"]
        check_attempt_history(server.engine, [safe, unsafe])


@pytest.mark.parametrize("kind", BACKENDS)
def test_sigterm_lets_the_running_task_finish(
    make_database: DatabaseFactory, kind: str, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    with run_server(make_database(kind)) as server:
        namespace, keys, queue_name = _setup(server)
        with OrbitClient(server.base_url, api_key=keys["admin"]) as client:
            task_id = client.submit_task(
                namespace, queue_name, "slow", {"seconds": 1.5}, idempotency_key=str(uuid.uuid4())
            ).task.id
            # The lease is not what is tested: 10 s, so that the 1.5 s handler keeps it on a loaded machine
            # (with 2 s, a heartbeat 1.3 s late would lose it, and the report after SIGTERM be refused).
            worker = WorkerProcess(
                server, namespace, keys["work"], queue_name, tmp_path / "w.log", lease_seconds=10
            )
            workers.append(worker)
            worker.expect("started")
            worker.proc.send_signal(signal.SIGTERM)
            worker.expect("stopped")
            assert worker.stop(None) == 0
            task = client.get_task(namespace, task_id)
        assert task.status == "SUCCEEDED" and task.result == "slept" and task.attempt_count == 1


TASKS = 500
PROCESSES = 4


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_four_worker_processes_run_500_tasks_each_exactly_once(
    make_database: DatabaseFactory, tmp_path: Path, workers: list[WorkerProcess], kind: str
) -> None:
    with run_server(make_database(kind)) as server:
        namespace, keys, queue_name = _setup(server)
        with OrbitClient(server.base_url, api_key=keys["submit"]) as client:

            def submit(n: int) -> str:
                return client.submit_task(
                    namespace, queue_name, "echo", {"n": n}, idempotency_key=f"load-{n}"
                ).task.id

            with ThreadPoolExecutor(8) as pool:
                ids = list(pool.map(submit, range(TASKS)))
        journal = tmp_path / "journal.txt"
        started = time.monotonic()
        for i in range(PROCESSES):
            worker = WorkerProcess(server, namespace, keys["work"], queue_name, tmp_path / f"w{i}.log",
                                   concurrency=4, lease_seconds=10, journal=journal)  # fmt: skip
            workers.append(worker)
        deadline = time.monotonic() + 180
        with server.engine.connect() as conn:
            while True:
                done = conn.scalar(
                    sa.select(sa.func.count()).select_from(tasks).where(tasks.c.status == "SUCCEEDED")
                )
                conn.rollback()
                if done == TASKS:
                    break
                assert time.monotonic() < deadline, f"only {done} of {TASKS} tasks succeeded"
                time.sleep(0.2)
        elapsed = time.monotonic() - started
        assert [w.stop() for w in workers] == [0] * PROCESSES

        history = check_attempt_history(server.engine, ids)
        assert history.tasks == TASKS and history.succeeded_attempts == TASKS
        with server.engine.connect() as conn:
            per_worker = Counter(
                conn.execute(
                    sa.select(task_attempts.c.worker_id).where(task_attempts.c.status == "SUCCEEDED")
                ).scalars()
            )
            results = dict(conn.execute(sa.select(tasks.c.id, tasks.c.result)).all())
        assert sorted(r["n"] for r in results.values()) == list(range(TASKS))
        runs = Counter(line.split()[0] for line in journal.read_text().splitlines())
        assert set(runs) == set(ids)
        assert len(per_worker) == PROCESSES, per_worker  # every process took part
        print(
            f"{TASKS} tasks by {PROCESSES} worker processes in {elapsed:.1f} s ({TASKS / elapsed:.0f} tasks/s); "
            f"attempts {history.attempts}, handler runs {sum(runs.values())}, per worker {dict(per_worker)}",
            file=sys.stderr,
        )
