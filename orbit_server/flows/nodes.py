"""Entering nodes: what a token does on each node type (task, poll, timer, signal, parallel, join, choice,
end), in the transaction that moves it there (README "Flows: graph format"; the rules in :mod:`.engine`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from orbit_client import ChoiceNode, SubmitOptions, TaskSubmission
from orbit_server import errors
from orbit_server.db import faults as _faults
from orbit_server.db.engine import to_naive_utc
from orbit_server.db.schema import flow_signals, flow_steps, flow_timers
from orbit_server.flows import paths
from orbit_server.flows.advance import (
    _INSERT_KEY,
    _INSERT_STEP,
    _INSERT_TASK,
    _INSERT_TASK_EVENT,
    _INSERT_TIMER,
    _INSERT_TOKEN,
    _MAX_HOPS,
    ACTIVE,
    ARRIVED,
    CANCELLED,
    COMPLETED,
    DONE,
    FORKED,
    PENDING,
    WAITING,
    Advance,
    FlowFailure,
    failure,
    finish,
    lock_token,
    render,
    scope_for,
    set_token,
)
from orbit_server.tasks import store, transitions

# ------------------------------------------------------------------ entering nodes


def enter(adv: Advance, token: dict[str, Any], node_id: str, *, event: str = "entered",
           data: Any = None) -> dict[str, Any]:  # fmt: skip
    """Move ``token`` onto ``node_id`` (a new activation) and do the node's work, going on through
    nodes that need no waiting. Returns the token as written."""
    for _ in range(_MAX_HOPS):
        node = adv.nodes[node_id]
        kind = node["type"]
        activation = int(token["activation"]) + 1
        moved: dict[str, Any] = {"node_id": node_id, "activation": activation, "task_id": None, "fire_at": None,
                                 "waiting_for": None}  # fmt: skip
        if kind == "task":
            task_id, rows = prepare_task(adv, token, node_id, node, activation, round_=0)
            token = set_token(adv, token, event, data=data, **{**moved, "state": WAITING, "waiting_for": "task",
                                                                "task_id": task_id})  # fmt: skip
            insert_task(adv, rows)
            return token
        if kind == "poll":
            task_id, rows = prepare_task(adv, token, node_id, node, activation, round_=1)
            token = set_token(adv, token, event, data=data, **{**moved, "state": WAITING, "task_id": task_id,
                                                                "waiting_for": poll_label(node, 1)})  # fmt: skip
            insert_task(adv, rows)
            return token
        if kind == "timer":
            fire_at = _timer_fire_at(adv, node_id, node)
            if fire_at <= adv.now:  # a past time fires at once
                token = set_token(adv, token, event, data=data, state=ACTIVE, **moved)
                event, data, node_id = "timer_fired", {"fire_at": fire_at.isoformat()}, node["next"]
                continue
            token = set_token(adv, token, event, data=data, **{**moved, "state": WAITING, "waiting_for": "timer",
                                                                "fire_at": fire_at})  # fmt: skip
            insert_timer(adv, token, "timer", fire_at)
            return token
        if kind == "signal":
            name = node["signal"]
            signal = oldest_signal(adv, name)
            if signal is not None:
                token = set_token(adv, token, event, data=data, state=ACTIVE, **moved)
                consume_signal(adv, token, signal)
                event, data, node_id = (
                    "signal_received",
                    {"signal": name, "signal_id": signal["id"]},
                    node["next"],
                )
                continue
            timeout = node.get("timeout_seconds")
            timeout_at = adv.now + timedelta(seconds=float(timeout)) if timeout is not None else None
            token = set_token(adv, token, event, data=data, **{**moved, "state": WAITING,
                                                                "waiting_for": f"signal:{name}", "fire_at": timeout_at})  # fmt: skip
            if timeout_at is not None:
                insert_timer(adv, token, "signal_timeout", timeout_at)
            return token
        if kind == "parallel":
            branches = list(node["branches"])
            token = set_token(adv, token, event, data=data, **{**moved, "state": FORKED, "waiting_for": "join",
                                                                "children_open": len(branches)})  # fmt: skip
            children = [
                {"id": str(uuid.uuid4()), "instance_id": token["instance_id"], "node_id": branch, "state": ACTIVE,
                 "activation": 0, "version": 1, "parent_id": token["id"], "children_open": 0, "task_id": None,
                 "waiting_for": None, "fire_at": None, "created_at": adv.now, "updated_at": adv.now}
                for branch in branches
            ]  # fmt: skip
            adv.conn.execute(_INSERT_TOKEN, children)
            for child in children:
                adv.record("forked", child, to_state=ACTIVE, data={"parent_id": token["id"]})
            adv.wake()
            return token
        if kind == "join":
            return _arrive(adv, token, node_id, moved, event, data)
        if kind == "choice":
            token = set_token(adv, token, event, data=data, state=ACTIVE, **moved)
            chosen = _choose(adv, node_id, node)
            event, data, node_id = "chose", {"next": chosen}, chosen
            continue
        if kind == "end":
            # Decided (reads only) before anything is written: a failure here leaves the token where it was.
            if token["parent_id"] is not None:
                raise failure("flow_invalid", node_id, "an end inside a parallel branch")
            status = node.get("status") or COMPLETED
            output = render(adv, node_id, node["output"]) if node.get("output") is not None else None
            error = None if status == COMPLETED else {"code": "flow_ended", "node": node_id,
                                                      "message": f"the flow reached end node {node_id!r} ({status})"}  # fmt: skip
            token = set_token(adv, token, event, data=data, state=DONE, **moved)
            finish(adv, status, output=output, error=error)
            return token
        raise failure("flow_invalid", node_id, f"unknown node type {kind!r}")
    raise failure(
        "flow_loop", node_id, f"more than {_MAX_HOPS} nodes passed without a wait (a cycle of choices?)"
    )


def poll_label(node: Mapping[str, Any], round_: int) -> str:
    return f"poll round {round_} of {node['max_rounds']}"


def _timer_fire_at(adv: Advance, node_id: str, node: Mapping[str, Any]) -> datetime:
    if node.get("seconds") is not None:
        return adv.now + timedelta(seconds=float(node["seconds"]))
    path = node["until"]
    try:
        when = paths.resolve_time(path, scope_for(adv, path), node=node_id)
    except paths.FlowPathError as exc:
        raise FlowFailure(exc.as_error()) from None
    naive = to_naive_utc(when)
    assert naive is not None
    return naive


def _choose(adv: Advance, node_id: str, node: Mapping[str, Any]) -> str:
    choice = _CHOICES.get(id(node))
    if choice is None or choice[0] is not node:
        choice = _CHOICES[id(node)] = (node, ChoiceNode.model_validate(node))
    return paths.choose(choice[1], scope_for(adv, node))


#: Parsed choice nodes, by the identity of their (cached, immutable) graph dict.
_CHOICES: dict[int, tuple[Mapping[str, Any], ChoiceNode]] = {}


def _arrive(adv: Advance, token: dict[str, Any], join_id: str, moved: dict[str, Any], event: str,
            data: Any) -> dict[str, Any]:  # fmt: skip
    """A child token arrives at its join: the last arrival moves the parent on (module docstring)."""
    if token["parent_id"] is None:  # a join outside any block: the validator refuses it; pass through
        token = set_token(adv, token, event, data=data, state=ACTIVE, **moved)
        return enter(adv, token, adv.nodes[join_id]["next"], event="joined")
    parent = lock_token(adv.conn, token["parent_id"])
    if parent is None or parent["state"] != FORKED:
        raise errors.ConcurrentUpdate(f"the parent of flow token {token['id']} is not waiting at its join")
    token = set_token(adv, token, event, data=data, state=ARRIVED, **moved)
    left = int(parent["children_open"]) - 1
    if left > 0:
        set_token(
            adv, parent, "branch_arrived", data={"child_id": token["id"], "open": left}, children_open=left
        )
        return token
    parent = set_token(adv, parent, "joined", data={"last_child_id": token["id"]}, children_open=0, state=ACTIVE,
                        node_id=join_id, activation=int(parent["activation"]) + 1, waiting_for=None)  # fmt: skip
    enter(adv, parent, adv.nodes[join_id]["next"])
    return token


# ------------------------------------------------------------------ tasks


def prepare_task(adv: Advance, token: Mapping[str, Any], node_id: str, node: Mapping[str, Any], activation: int,
                  *, round_: int) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """Build (reads only) the rows of a step's task; ``(task id, rows)``. An existing task of this key
    (a retried advance) is reused. Raises FlowFailure for a missing path or queue, bad options."""
    inst = adv.instance
    key = f"flow:{inst['id']}:{node_id}:{token['id']}.{activation}" + (f":{round_}" if round_ else "")
    params = render(adv, node_id, node.get("params", {}))
    template = node.get("concurrency_key")
    try:
        concurrency_key = paths.render_concurrency_key(template, scope_for(adv, template or ""), node=node_id)
    except paths.FlowPathError as exc:
        raise FlowFailure(exc.as_error()) from None
    timeout = node.get("timeout_seconds")
    deadline = adv.now + timedelta(seconds=float(timeout)) if timeout is not None else None
    if node["type"] == "poll" and node.get("deadline_seconds") is not None:
        poll_deadline = poll_started(adv, token, activation) + timedelta(
            seconds=float(node["deadline_seconds"])
        )
        deadline = min(deadline, poll_deadline) if deadline is not None else poll_deadline
    try:
        submission = TaskSubmission(
            queue=node["queue"], handler=node["handler"], params=params,
            options=SubmitOptions(max_attempts=node.get("max_attempts"), retry_safe=node.get("retry_safe"),
                                  deadline=deadline.replace(tzinfo=UTC) if deadline else None,
                                  concurrency_key=concurrency_key, priority=node.get("priority")),
        )  # fmt: skip
    except ValueError as exc:
        raise failure("flow_invalid_step", node_id, f"its task is not valid: {exc}") from None
    found = adv.conn.execute(
        store.lookup_statement(adv.conn), {"ns": inst["namespace_id"], "key": key, "queue": submission.queue}
    ).mappings().one()  # fmt: skip
    if found["task_id"] is not None:
        return found["task_id"], {}
    if found["queue_id"] is None:
        raise failure("queue_not_found", node_id,
                       f"queue {submission.queue!r} does not exist in namespace {inst['ns_name']!r}")  # fmt: skip
    principal = store.Principal(
        key_id=0, namespace_id=inst["namespace_id"], namespace=inst["ns_name"], role="submit"
    )
    task_id = str(uuid.uuid4())
    row = store.task_row(principal, submission, task_id, found["queue_id"], adv.now, adv.settings.default_max_attempts,
                         inst["traceparent"])  # fmt: skip
    row.update(flow_instance_id=inst["id"], flow_token_id=token["id"], flow_activation=activation)
    accepted = store.accepted_event_row(principal, task_id, adv.now)
    accepted["actor"] = f"flow:{inst['id']}"
    return task_id, {
        "key": store.key_row(principal, key, store.request_digest(submission), task_id, adv.now, adv.settings.key_ttl),
        "task": row,
        "event": accepted,
        "step": {"instance_id": inst["id"], "token_id": token["id"], "node_id": node_id, "activation": activation,
                 "round": round_, "task_id": task_id, "created_at": adv.now},
    }  # fmt: skip


def insert_task(adv: Advance, rows: Mapping[str, Any]) -> None:
    """Insert a prepared step task: submission key, task, accepted event (the acceptance rows), step."""
    _faults.flow_point("token-moved")
    if not rows:
        return  # the task of this activation exists already (found by its key)
    conn = adv.conn
    conn.execute(_INSERT_KEY, rows["key"])
    conn.execute(_INSERT_TASK, rows["task"])
    conn.execute(_INSERT_TASK_EVENT, rows["event"])
    _faults.flow_point("task-inserted")
    conn.execute(_INSERT_STEP, rows["step"])
    _faults.flow_point("step-inserted")
    adv.created_tasks += 1


def poll_started(adv: Advance, token: Mapping[str, Any], activation: int) -> datetime:
    """When the poll's activation started: its first round's creation (rows, never memory: invariant 11)."""
    started = adv.conn.execute(
        sa.select(sa.func.min(flow_steps.c.created_at)).where(
            flow_steps.c.token_id == token["id"], flow_steps.c.activation == activation
        )
    ).scalar()
    return adv.now if started is None else transitions._naive(started)


def insert_timer(
    adv: Advance, token: Mapping[str, Any], kind: str, fire_at: datetime, round_: int = 0
) -> None:
    adv.conn.execute(
        _INSERT_TIMER,
        {"instance_id": token["instance_id"], "token_id": token["id"], "activation": token["activation"],
         "kind": kind, "round": round_, "fire_at": fire_at, "state": PENDING, "created_at": adv.now},
    )  # fmt: skip


# ------------------------------------------------------------------ signals


def oldest_signal(adv: Advance, name: str, *, received_by: datetime | None = None) -> dict[str, Any] | None:
    """The oldest unconsumed signal ``name`` (locked), or ``None``; ``received_by``: received at or before
    this time (naive UTC) only."""
    query = sa.select(flow_signals.c.id, flow_signals.c.name, flow_signals.c.payload).where(
        flow_signals.c.instance_id == adv.instance["id"], flow_signals.c.name == name,
        flow_signals.c.consumed_at.is_(None),
    )  # fmt: skip
    if received_by is not None:
        query = query.where(flow_signals.c.received_at <= received_by)
    row = adv.conn.execute(
        query
        .order_by(flow_signals.c.received_at, flow_signals.c.id)
        .limit(1)
        .with_for_update()
    ).mappings().first()  # fmt: skip
    return dict(row) if row is not None else None


def consume_signal(adv: Advance, token: Mapping[str, Any], signal: Mapping[str, Any]) -> None:
    done = adv.conn.execute(
        flow_signals.update()
        .where(flow_signals.c.id == signal["id"], flow_signals.c.consumed_at.is_(None))
        .values(consumed_by_token=token["id"], consumed_activation=token["activation"], consumed_at=adv.now)
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"flow signal {signal['id']} was consumed concurrently")
    adv.forget_scope()


def cancel_timers(adv: Advance, token: Mapping[str, Any], kind: str) -> None:
    adv.conn.execute(
        flow_timers.update()
        .where(flow_timers.c.token_id == token["id"], flow_timers.c.activation == token["activation"],
               flow_timers.c.kind == kind, flow_timers.c.state == PENDING)
        .values(state=CANCELLED, fired_at=adv.now)
    )  # fmt: skip
