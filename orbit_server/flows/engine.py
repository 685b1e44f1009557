"""The token engine: how one transaction advances one token (seed 002 §4-§9; seed 001 §4-§6.3, inv. 9-12).

Every function here takes the caller's connection and does one short unit of work; run it with
:func:`orbit_server.db.transact.transact`, which commits, rolls back or retries it (a deadlock, a lock
wait timeout or :class:`errors.ConcurrentUpdate`).

The rules:

- **Positions are token rows** with an optimistic ``version``: every update is ``UPDATE flow_tokens
  ... WHERE id = ? AND version = ?`` and its row count is checked (:func:`.advance.set_token`). A token
  ``ACTIVE`` is on a node whose entry is not done yet; entering it (:func:`enter_token`) does the
  node's work and moves on through instant nodes (choice, join, a timer already due, a signal already
  buffered) until the token waits (``WAITING``), forks (``FORKED``), arrives at a join (``ARRIVED``)
  or ends (``DONE``). Each entry bumps the token's ``activation``.
- **A task step's task is created in the transaction that moves the token onto its node**
  (invariant 9), through the accepted-task rows of :mod:`orbit_server.tasks.store` (submission key, task,
  ``accepted`` event) with the key ``flow:<instance>:<node>:<token>.<activation>`` (a poll round
  adds ``:<round>``), so a retried advance finds the task instead of making a second one.
- **Internal events** (``flow_events``, written by the task's terminal transition,
  :mod:`.hooks`) are consumed by the transaction that applies them (:func:`apply_event`):
  ``consumed_at IS NULL`` → set, row count checked. An event that is not for the token's current
  activation and task is consumed as ``stale`` and changes nothing.
- **Instance lock order**: a transaction that advances a token first takes a *shared* lock on its
  instance row; pause, resume, cancel and signals take an *exclusive* one. So an advance never
  interleaves with a change of the execution gate (a paused instance starts no task, timer or poll
  round, invariant 12) and a signal never misses a wait that is being entered. Then tokens (child
  before parent), then timers, signals and tasks.
- **Join**: an arriving child locks its parent (``FOR UPDATE``), marks itself ``ARRIVED`` and
  decrements the parent's ``children_open``, all conditional; the arrival that brings it to 0 moves
  the parent on. Arrivals are serialised by the parent's row lock and each reads the counter with
  that locking read (the newest committed value at any isolation level), so the join passes exactly
  once and is never left waiting.
- **History**: every token and instance change appends a ``flow_history`` row in its transaction
  (seed 002 §8), written in one multi-row ``INSERT`` before commit (:meth:`Advance.flush`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import TaskStatus
from orbit_server.db import faults as _faults
from orbit_server.db.schema import flow_events, flow_steps, flow_timers, flow_tokens, tasks
from orbit_server.flows import paths
from orbit_server.flows.advance import (
    ACTIVE,
    ADVANCES,
    CANCELLED,
    COMPLETED,
    FAILED,
    FINISHED,
    FIRED,
    FLOW_ACTOR,
    PAUSED,
    PENDING,
    RUNNING,
    WAITING,
    Advance,
    EngineSettings,
    FlowFailure,
    Outcome,
    begin,
    done,
    failure,
    finish,
    guarded,
    load_graph,
    lock_token,
    runnable,
    set_instance,
    set_token,
)
from orbit_server.flows.nodes import (
    cancel_timers,
    consume_signal,
    enter,
    insert_task,
    insert_timer,
    oldest_signal,
    poll_label,
    poll_started,
    prepare_task,
)

__all__ = [
    "ACTIVE",
    "ADVANCES",
    "CANCELLED",
    "COMPLETED",
    "FAILED",
    "FINISHED",
    "FLOW_ACTOR",
    "PAUSED",
    "PENDING",
    "RUNNING",
    "WAITING",
    "Advance",
    "EngineSettings",
    "FlowFailure",
    "Outcome",
    "apply_event",
    "begin",
    "deliver_signal",
    "enter",
    "enter_token",
    "finish",
    "fire_timer",
    "guarded",
    "load_graph",
    "match_signal",
    "set_instance",
]


def enter_token(conn: Connection, token_id: str, settings: EngineSettings) -> Outcome:
    """Do the entry of an ``ACTIVE`` token (a fork's child, a token whose entry a crash interrupted)."""
    instance_id = conn.execute(
        sa.select(flow_tokens.c.instance_id).where(flow_tokens.c.id == token_id)
    ).scalar()
    if instance_id is None:
        return Outcome("none")
    adv = begin(conn, instance_id, settings)
    if adv is None or not runnable(adv):
        return Outcome("deferred" if adv is not None and adv.instance["status"] == PAUSED else "none")
    token = lock_token(conn, token_id)
    if token is None or token["state"] != ACTIVE:
        return Outcome("none")
    _faults.flow_point("claimed")
    # An ACTIVE token sits on node_id with its entry not done: entering it is its next activation.
    guarded(adv, enter, adv, token, token["node_id"])
    return done(adv, "applied")


def apply_event(conn: Connection, event_id: str, settings: EngineSettings) -> Outcome:
    """Consume one internal event and advance its token (seed 001 §6.3), or consume it as ``stale``.

    Left pending (``deferred``, nothing written) while the instance is paused: applied on resume
    (invariant 12).
    """
    event = conn.execute(sa.select(flow_events).where(flow_events.c.id == event_id)).mappings().first()
    if event is None or event["consumed_at"] is not None:
        return Outcome("none")
    adv = begin(conn, event["instance_id"], settings)
    if adv is None:
        return Outcome("none")
    if adv.instance["status"] == PAUSED:
        ADVANCES.labels("deferred").inc()
        return Outcome("deferred")
    token = lock_token(conn, event["token_id"])
    current = (
        adv.instance["status"] == RUNNING
        and token is not None
        and token["state"] == WAITING
        and token["activation"] == event["activation"]
        and token["task_id"] == event["task_id"]
    )
    outcome = "applied" if current else ("finished" if adv.instance["status"] in FINISHED else "stale")
    claimed = conn.execute(
        flow_events.update()
        .where(flow_events.c.id == event_id, flow_events.c.consumed_at.is_(None))
        .values(consumed_at=adv.now, outcome=outcome)
    )
    if claimed.rowcount != 1:
        return Outcome("none")  # consumed by a concurrent advance
    _faults.flow_point("claimed")
    if not current:
        return done(adv, "stale")
    assert token is not None
    guarded(adv, _apply_result, adv, token, event)
    return done(adv, "applied")


def _apply_result(adv: Advance, token: dict[str, Any], event: Mapping[str, Any]) -> None:
    status = TaskStatus(event["status"])
    task = adv.conn.execute(
        sa.select(tasks.c.result, tasks.c.error, tasks.c.finished_at).where(tasks.c.id == event["task_id"])
    ).mappings().first()  # fmt: skip
    result = task["result"] if task else None
    error = task["error"] if task else None
    adv.conn.execute(
        flow_steps.update()
        .where(flow_steps.c.task_id == event["task_id"])
        .values(status=status.value, result=result, error=error,
                finished_at=adv.now if status is not TaskStatus.NEEDS_REVIEW else None)
    )  # fmt: skip
    adv.forget_scope()
    node_id = token["node_id"]
    node = adv.nodes[node_id]
    data = {"task_id": event["task_id"], "status": status.value, "event_id": event["id"]}
    if status is TaskStatus.NEEDS_REVIEW:
        set_token(adv, token, "task_needs_review", data=data, waiting_for="review")
        return
    if node["type"] == "poll":
        _poll_round_done(adv, token, node_id, node, status, result, data)
        return
    if status is TaskStatus.SUCCEEDED:
        enter(adv, token, node["next"], event="task_succeeded", data=data)
    elif node.get("on_failure"):
        enter(adv, token, node["on_failure"], event="task_failed", data=data)
    else:
        raise failure("step_failed", node_id, f"its task {event['task_id']} ended {status.value}",
                       task_id=event["task_id"], status=status.value, task_error=error)  # fmt: skip


def _poll_round_done(adv: Advance, token: dict[str, Any], node_id: str, node: Mapping[str, Any], status: TaskStatus,
                     result: Any, data: dict[str, Any]) -> None:  # fmt: skip
    if status is TaskStatus.SUCCEEDED and paths.poll_done(node["done_path"], result):
        enter(adv, token, node["next"], event="poll_done", data=data)
        return
    rounds = int(adv.conn.execute(
        sa.select(sa.func.count()).select_from(flow_steps)
        .where(flow_steps.c.token_id == token["id"], flow_steps.c.activation == token["activation"])
    ).scalar_one())  # fmt: skip
    next_at = adv.now + timedelta(seconds=float(node["interval_seconds"]))
    spent = rounds >= int(node["max_rounds"])
    if not spent and node.get("deadline_seconds") is not None:
        started = poll_started(adv, token, int(token["activation"]))
        spent = next_at > started + timedelta(seconds=float(node["deadline_seconds"]))
    data = {**data, "rounds": rounds}
    if spent:
        if node.get("on_exhausted"):
            enter(adv, token, node["on_exhausted"], event="poll_exhausted", data=data)
            return
        raise failure("poll_exhausted", node_id, f"the poll spent its budget ({rounds} rounds) without being done",
                       rounds=rounds)  # fmt: skip
    token = set_token(adv, token, "poll_round_finished", data=data, task_id=None, fire_at=next_at,
                       waiting_for=poll_label(node, rounds + 1))  # fmt: skip
    insert_timer(adv, token, "poll_round", next_at, round_=rounds + 1)


def fire_timer(conn: Connection, timer_id: int, settings: EngineSettings) -> Outcome:
    """Fire one due timer: claimed with ``SKIP LOCKED`` plus a conditional update, so of two servers
    exactly one fires it; a paused instance's timer waits for the resume (invariant 12)."""
    timer = conn.execute(sa.select(flow_timers).where(flow_timers.c.id == timer_id)).mappings().first()
    if timer is None or timer["state"] != PENDING:
        return Outcome("none")
    adv = begin(conn, timer["instance_id"], settings)
    if adv is None or not runnable(adv):
        return Outcome("deferred" if adv is not None and adv.instance["status"] == PAUSED else "none")
    claimed = conn.execute(
        _faults.skip_locked(
            sa.select(flow_timers.c.id).where(flow_timers.c.id == timer_id, flow_timers.c.state == PENDING,
                                              flow_timers.c.fire_at <= adv.now)
        )
    ).first()  # fmt: skip
    if claimed is None:
        return Outcome("none")  # another server holds it, or it is not due (any more)
    fired = conn.execute(
        flow_timers.update()
        .where(flow_timers.c.id == timer_id, flow_timers.c.state == PENDING)
        .values(state=FIRED, fired_at=adv.now)
    )
    if fired.rowcount != 1:
        return Outcome("none")
    _faults.flow_point("claimed")
    token = lock_token(conn, timer["token_id"])
    kind = timer["kind"]
    current = (
        token is not None
        and token["state"] == WAITING
        and token["activation"] == timer["activation"]
        and (
            (kind == "timer" and token["waiting_for"] == "timer")
            or (kind == "signal_timeout" and str(token["waiting_for"]).startswith("signal:"))
            or (
                kind == "poll_round"
                and token["task_id"] is None
                and str(token["waiting_for"]).startswith("poll")
            )
        )
    )
    if not current:
        return done(adv, "stale")
    assert token is not None
    guarded(adv, _timer_fired, adv, token, dict(timer))
    return done(adv, "applied")


def _timer_fired(adv: Advance, token: dict[str, Any], timer: Mapping[str, Any]) -> None:
    node_id = token["node_id"]
    node = adv.nodes[node_id]
    data = {"timer_id": timer["id"], "kind": timer["kind"]}
    if timer["kind"] == "timer":
        enter(adv, token, node["next"], event="timer_fired", data=data)
    elif timer["kind"] == "signal_timeout":
        # A signal received before the timeout fell due, still buffered (it came while the instance was
        # paused, and the resume's match has not run yet: another server's loop, a crash), wins: the
        # pause delayed it, it did not come late.
        signal = oldest_signal(adv, node["signal"], received_by=timer["fire_at"])
        if signal is not None:
            consume_signal(adv, token, signal)
            enter(adv, token, node["next"], event="signal_received",
                  data={"signal": node["signal"], "signal_id": signal["id"]})  # fmt: skip
            return
        enter(adv, token, node["on_timeout"], event="signal_timed_out", data=data)
    else:
        round_ = int(timer["round"])
        if node.get("deadline_seconds") is not None:
            # Due before the poll's deadline but fired after it (paused, no loop ran): no round past it.
            deadline = poll_started(adv, token, int(token["activation"])) + timedelta(
                seconds=float(node["deadline_seconds"])
            )
            if adv.now >= deadline:
                rounds = round_ - 1
                if node.get("on_exhausted"):
                    enter(
                        adv,
                        token,
                        node["on_exhausted"],
                        event="poll_exhausted",
                        data={**data, "rounds": rounds},
                    )
                    return
                raise failure("poll_exhausted", node_id, f"the poll's deadline passed after {rounds} rounds "
                              "without it being done", rounds=rounds)  # fmt: skip
        task_id, rows = prepare_task(adv, token, node_id, node, int(token["activation"]), round_=round_)
        set_token(adv, token, "poll_round_started", data={**data, "round": round_}, task_id=task_id, fire_at=None,
                   waiting_for=poll_label(node, round_))  # fmt: skip
        insert_task(adv, rows)


def match_signal(conn: Connection, token_id: str, settings: EngineSettings) -> Outcome:
    """Give a waiting signal token the oldest buffered signal of its name, if any (after a resume)."""
    instance_id = conn.execute(
        sa.select(flow_tokens.c.instance_id).where(flow_tokens.c.id == token_id)
    ).scalar()
    if instance_id is None:
        return Outcome("none")
    adv = begin(conn, instance_id, settings, exclusive=True)
    if adv is None or not runnable(adv):
        return Outcome("none")
    token = lock_token(conn, token_id)
    if token is None or token["state"] != WAITING or not str(token["waiting_for"]).startswith("signal:"):
        return Outcome("none")
    if not deliver_signal(adv, token):
        return Outcome("none")
    return done(adv, "applied")


def deliver_signal(adv: Advance, token: dict[str, Any]) -> bool:
    """If a signal of the name ``token`` waits for is buffered, consume the oldest and move the token on.

    With a timeout (the token's ``fire_at``), only a signal received by then counts: a later one came after
    the wait timed out, by the database clock, however late the timer fires (it stays unconsumed)."""
    name = str(token["waiting_for"]).removeprefix("signal:")
    signal = oldest_signal(adv, name, received_by=token["fire_at"])
    if signal is None:
        return False
    consume_signal(adv, token, signal)
    cancel_timers(adv, token, "signal_timeout")
    node = adv.nodes[token["node_id"]]
    guarded(adv, enter, adv, token, node["next"], event="signal_received",
            data={"signal": name, "signal_id": signal["id"]})  # fmt: skip
    return True
