"""Checks of task execution read straight from ``task_attempts`` (shared by integration and acceptance tests)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_server.db.schema import task_attempts, tasks

LIVE = ("LEASED", "RUNNING")


@dataclass
class History:
    tasks: int
    attempts: int
    succeeded_attempts: int


def check_attempt_history(engine: Engine, task_ids: Iterable[str] | None = None) -> History:
    """Assert that no task ever had two live attempts, and that finished tasks have one winner.

    For each task, attempts ordered by generation must be 1, 2, 3, ...; every attempt but the
    newest is finished; an attempt is leased no earlier than the previous one finished (both by
    the database clock, so the grants never overlapped); the task's ``current_attempt_id`` is the
    newest; a ``SUCCEEDED`` task has exactly one ``SUCCEEDED`` attempt, whose result is the
    task's; no other task has one.
    """
    query = sa.select(
        task_attempts.c.task_id,
        task_attempts.c.id,
        task_attempts.c.generation,
        task_attempts.c.status,
        task_attempts.c.leased_at,
        task_attempts.c.finished_at,
        task_attempts.c.result,
    )
    task_query = sa.select(tasks.c.id, tasks.c.status, tasks.c.current_attempt_id, tasks.c.result)
    wanted = list(task_ids) if task_ids is not None else None
    if wanted is not None:
        query = query.where(task_attempts.c.task_id.in_(wanted))
        task_query = task_query.where(tasks.c.id.in_(wanted))
    with engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
        task_rows = {row["id"]: row for row in conn.execute(task_query).mappings()}
    by_task: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        by_task[row["task_id"]].append(row)
    succeeded = 0
    for task_id, attempts in by_task.items():
        attempts.sort(key=lambda a: a["generation"])
        assert [a["generation"] for a in attempts] == list(range(1, len(attempts) + 1)), (task_id, attempts)
        for older, newer in itertools.pairwise(attempts):
            assert older["status"] not in LIVE, (
                f"task {task_id}: attempt {older['generation']} live beside a newer"
            )
            assert older["finished_at"] is not None
            assert newer["leased_at"] >= older["finished_at"], (
                f"task {task_id}: overlapping grants {older} {newer}"
            )
        task = task_rows[task_id]
        assert task["current_attempt_id"] == attempts[-1]["id"], task_id
        winners = [a for a in attempts if a["status"] == "SUCCEEDED"]
        if task["status"] == "SUCCEEDED" and winners:
            assert len(winners) == 1, f"task {task_id} succeeded {len(winners)} times"
            assert winners[0]["result"] == task["result"]
        else:
            assert not winners, f"task {task_id} is {task['status']} but has a SUCCEEDED attempt"
        succeeded += len(winners)
    return History(tasks=len(by_task), attempts=len(rows), succeeded_attempts=succeeded)
