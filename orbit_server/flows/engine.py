"""The token engine: how one transaction advances one token (seed 002 §4-§9; seed 001 §4-§6.3, inv. 9-12).

Every function here takes the caller's connection and does one short unit of work; run it with
:func:`orbit_server.execution.transact`, which commits, rolls back or retries it (a deadlock, a lock
wait timeout or :class:`errors.ConcurrentUpdate`).

The rules:

- **Positions are token rows** with an optimistic ``version``: every update is ``UPDATE flow_tokens
  ... WHERE id = ? AND version = ?`` and its row count is checked (:func:`_set_token`). A token
  ``ACTIVE`` is on a node whose entry is not done yet; entering it (:func:`enter_token`) does the
  node's work and moves on through instant nodes (choice, join, a timer already due, a signal already
  buffered) until the token waits (``WAITING``), forks (``FORKED``), arrives at a join (``ARRIVED``)
  or ends (``DONE``). Each entry bumps the token's ``activation``.
- **A task step's task is created in the transaction that moves the token onto its node**
  (invariant 9), through the accepted-task rows of :mod:`orbit_server.store` (submission key, task,
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

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from prometheus_client import Counter
from sqlalchemy.engine import Connection

from orbit_client import ChoiceNode, SubmitOptions, TaskStatus, TaskSubmission

from .. import _faults, errors, execution, store
from .._db import to_naive_utc
from ..schema import (
    flow_definitions,
    flow_events,
    flow_history,
    flow_instances,
    flow_signals,
    flow_steps,
    flow_timers,
    flow_tokens,
    flow_versions,
    namespaces,
    submission_keys,
    tasks,
)
from . import hooks, paths

__all__ = [
    "ADVANCES",
    "FLOW_ACTOR",
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

log = logging.getLogger("orbit_server.flows")

# Token states (FlowTokenState) and instance statuses (FlowInstanceStatus).
ACTIVE, WAITING, FORKED, ARRIVED, DONE, CANCELLED = (
    "ACTIVE",
    "WAITING",
    "FORKED",
    "ARRIVED",
    "DONE",
    "CANCELLED",
)
RUNNING, PAUSED, COMPLETED, FAILED = "RUNNING", "PAUSED", "COMPLETED", "FAILED"
FINISHED: Final = frozenset({COMPLETED, FAILED, CANCELLED})
LIVE_TOKENS: Final = (ACTIVE, WAITING, FORKED, ARRIVED)
PENDING, FIRED = "PENDING", "FIRED"

#: Advances by outcome, process-wide (every app's registry exposes it): applied (an event, timer,
#: entry or signal moved a token), stale (an event or timer for an activation that is over: nothing
#: changed), deferred (the instance is paused: left for resume), failed (the pass raised).
ADVANCES = Counter(
    "orbit_flow_advances",
    "Flow advances by outcome: applied, stale, deferred (instance paused) or failed.",
    ["outcome"],
    registry=None,
)

#: Most nodes one advance passes through without waiting (a cycle of choices would loop for ever).
_MAX_HOPS = 1000
#: The actor of the engine's own changes in the history.
FLOW_ACTOR = "flow-engine"
_FLOW_ACTOR = FLOW_ACTOR


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What step tasks inherit from the server's settings."""

    default_max_attempts: int = 3
    key_ttl: timedelta = timedelta(days=7)


class FlowFailure(Exception):
    """The instance cannot go on (a path is missing, a queue does not exist, a step failed with no
    ``on_failure``...): raised inside an advance, which then fails the instance in the same
    transaction with :attr:`error` (a JSON object naming the node)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "the flow failed"))
        self.error = error


# ------------------------------------------------------------------ statements

_UPDATE_TOKEN = flow_tokens.update().where(
    flow_tokens.c.id == sa.bindparam("b_id"), flow_tokens.c.version == sa.bindparam("b_version")
)
_UPDATE_INSTANCE = flow_instances.update().where(
    flow_instances.c.id == sa.bindparam("b_id"),
    flow_instances.c.state_version == sa.bindparam("b_version"),
)
_LOCK_TOKEN = sa.select(flow_tokens).where(flow_tokens.c.id == sa.bindparam("id")).with_for_update()
_INSERT_HISTORY = flow_history.insert()
_INSERT_TOKEN = flow_tokens.insert()
_INSERT_STEP = flow_steps.insert()
_INSERT_TIMER = flow_timers.insert()
_INSERT_TASK = tasks.insert()
_INSERT_KEY = submission_keys.insert()
_INSERT_TASK_EVENT = execution._INSERT_EVENT
_GRAPH = sa.select(flow_versions.c.graph).where(flow_versions.c.id == sa.bindparam("id"))
_KEY_TASK = sa.select(submission_keys.c.task_id).where(
    submission_keys.c.namespace_id == sa.bindparam("ns"),
    submission_keys.c.idempotency_key == sa.bindparam("key"),
)
#: Instance statements, built once per dialect: (shared lock, exclusive lock).
_LOCK_INSTANCE: dict[tuple[str, bool], sa.Select[Any]] = {}


def _instance_statement(conn: Connection, *, exclusive: bool) -> sa.Select[Any]:
    """The instance row with its namespace and flow names, version number and the database clock,
    locked (shared or exclusive); the names come from scalar subqueries, which lock nothing."""
    cache_key = (conn.dialect.name, exclusive)
    statement = _LOCK_INSTANCE.get(cache_key)
    if statement is None:
        i = flow_instances
        built = sa.select(
            i,
            execution._clock(conn).label("db_now"),
            sa.select(namespaces.c.name)
            .where(namespaces.c.id == i.c.namespace_id)
            .scalar_subquery()
            .label("ns_name"),
            sa.select(flow_definitions.c.name)
            .where(flow_definitions.c.id == i.c.definition_id)
            .scalar_subquery()
            .label("flow_name"),
            sa.select(flow_versions.c.version)
            .where(flow_versions.c.id == i.c.version_id)
            .scalar_subquery()
            .label("version_number"),
        ).where(i.c.id == sa.bindparam("id"))
        statement = _LOCK_INSTANCE[cache_key] = built.with_for_update(read=not exclusive)
    return statement


#: (database URL, version id) -> graph. A version never changes, so the cache never goes stale; the URL
#: keeps apart several databases served from one process (tests, tools).
_GRAPHS: dict[tuple[Any, int], dict[str, Any]] = {}


def load_graph(conn: Connection, version_id: int) -> dict[str, Any]:
    """The graph JSON of a flow version (cached in the process: a version never changes)."""
    key = (conn.engine.url, version_id)
    graph = _GRAPHS.get(key)
    if graph is None:
        graph = conn.execute(_GRAPH, {"id": version_id}).scalar_one()
        if len(_GRAPHS) >= 1000:
            _GRAPHS.clear()
        _GRAPHS[key] = graph
    return graph


# ------------------------------------------------------------------ the advance


@dataclass
class Advance:
    """One transaction's view of an instance: its locked row, graph, clock and pending history."""

    conn: Connection
    instance: dict[str, Any]
    graph: dict[str, Any]
    now: datetime
    settings: EngineSettings
    actor: str = _FLOW_ACTOR
    history: list[dict[str, Any]] = field(default_factory=list)
    created_tasks: int = 0
    _scope: dict[str, Any] | None = None

    @property
    def nodes(self) -> Mapping[str, Mapping[str, Any]]:
        return self.graph["nodes"]  # type: ignore[no-any-return]

    def record(self, event: str, token: Mapping[str, Any] | None = None, *, from_state: str | None = None,
               to_state: str | None = None, data: Any = None, actor: str | None = None) -> None:  # fmt: skip
        self.history.append(
            {
                "instance_id": self.instance["id"], "at": self.now, "event": event,
                "token_id": token["id"] if token else None, "node_id": token["node_id"] if token else None,
                "activation": token["activation"] if token else None, "from_state": from_state,
                "to_state": to_state, "actor": actor or self.actor, "data": data,
            }
        )  # fmt: skip

    def wake(self) -> None:
        """Have the flow loops of this process run once this transaction commits."""
        self.conn.info[hooks.WROTE_EVENT] = True

    def flush(self) -> None:
        """Write the pending history rows (call last, before the commit)."""
        if self.history:
            self.conn.execute(_INSERT_HISTORY, self.history)
            self.history = []
        _faults.flow_point("before-commit")

    def scope(self) -> dict[str, Any]:
        """The data paths resolve against: input, finished steps, signals, instance (README "Flows")."""
        if self._scope is None:
            steps: dict[str, Any] = {}
            for row in self.conn.execute(
                sa.select(flow_steps.c.node_id, flow_steps.c.status, flow_steps.c.result, flow_steps.c.error)
                .where(flow_steps.c.instance_id == self.instance["id"], flow_steps.c.status.is_not(None))
                .order_by(flow_steps.c.id)
            ):
                steps[row.node_id] = {"status": row.status, "result": row.result, "error": row.error}
            signals: dict[str, Any] = {}
            for name, payload in self.conn.execute(
                sa.select(flow_signals.c.name, flow_signals.c.payload)
                .where(flow_signals.c.instance_id == self.instance["id"])
                .order_by(flow_signals.c.id)
            ):
                signals[name] = payload
            inst = self.instance
            self._scope = {
                "input": inst["input"], "steps": steps, "signals": signals,
                "instance": {"id": inst["id"], "flow": inst["flow_name"], "version": inst["version_number"]},
            }  # fmt: skip
        return self._scope

    def forget_scope(self) -> None:
        self._scope = None


def begin(conn: Connection, instance_id: str, settings: EngineSettings, *, exclusive: bool = False,
          actor: str = _FLOW_ACTOR) -> Advance | None:  # fmt: skip
    """Lock the instance (shared, or exclusive) and read it, its graph and the clock; ``None`` if absent."""
    row = conn.execute(_instance_statement(conn, exclusive=exclusive), {"id": instance_id}).mappings().first()
    if row is None:
        return None
    instance = dict(row)
    now = execution._naive(instance.pop("db_now"))
    return Advance(conn, instance, load_graph(conn, instance["version_id"]), now, settings, actor=actor)


def _runnable(adv: Advance) -> bool:
    return adv.instance["status"] == RUNNING and not adv.instance["paused"]


def _lock_token(conn: Connection, token_id: str) -> dict[str, Any] | None:
    row = conn.execute(_LOCK_TOKEN, {"id": token_id}).mappings().first()
    return dict(row) if row is not None else None


def _set_token(adv: Advance, token: dict[str, Any], event: str, *, data: Any = None,
               **changes: Any) -> dict[str, Any]:  # fmt: skip
    """The conditional update of one token (on its id and version), with its history row."""
    changes["updated_at"] = adv.now
    version = int(token["version"])
    done = adv.conn.execute(
        _UPDATE_TOKEN, {"b_id": token["id"], "b_version": version, "version": version + 1, **changes}
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"flow token {token['id']} changed while it was being advanced")
    moved = {**token, **changes, "version": version + 1}
    adv.record(event, moved, from_state=token["state"], to_state=moved["state"], data=data)
    return moved


def _set_instance(
    adv: Advance, event: str, *, data: Any = None, actor: str | None = None, **changes: Any
) -> None:
    """The conditional update of the instance row (on its ``state_version``), with its history row."""
    inst = adv.instance
    changes["updated_at"] = adv.now
    version = int(inst["state_version"])
    done = adv.conn.execute(
        _UPDATE_INSTANCE, {"b_id": inst["id"], "b_version": version, "state_version": version + 1, **changes}
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"flow instance {inst['id']} changed while it was being updated")
    adv.record(event, from_state=inst["status"], to_state=changes.get("status", inst["status"]), data=data,
               actor=actor)  # fmt: skip
    inst.update(changes, state_version=version + 1)


# ------------------------------------------------------------------ paths


def _scope_for(adv: Advance, template: Any) -> Mapping[str, Any]:
    """The scope a template or path needs: steps and signals are read only when it refers to them."""
    if adv._scope is not None:
        return adv._scope
    text = template if isinstance(template, str) else json.dumps(template)
    if "$.steps" in text or "$.signals" in text:
        return adv.scope()
    inst = adv.instance
    return paths.make_scope(input=inst["input"], instance_id=inst["id"], flow=inst["flow_name"],
                            version=inst["version_number"])  # fmt: skip


def _render(adv: Advance, node_id: str, template: Any) -> Any:
    try:
        return paths.render(template, _scope_for(adv, template), node=node_id)
    except paths.FlowPathError as exc:
        raise FlowFailure(exc.as_error()) from None


def _failure(code: str, node_id: str, message: str, **extra: Any) -> FlowFailure:
    """An instance error in the shape of :meth:`paths.FlowPathError.as_error`: code, message, node."""
    return FlowFailure({"code": code, "message": f"node {node_id!r}: {message}", "node": node_id, **extra})


# ------------------------------------------------------------------ entering nodes


def _enter(adv: Advance, token: dict[str, Any], node_id: str, *, event: str = "entered",
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
            task_id, rows = _prepare_task(adv, token, node_id, node, activation, round_=0)
            token = _set_token(adv, token, event, data=data, **{**moved, "state": WAITING, "waiting_for": "task",
                                                                "task_id": task_id})  # fmt: skip
            _insert_task(adv, rows)
            return token
        if kind == "poll":
            task_id, rows = _prepare_task(adv, token, node_id, node, activation, round_=1)
            token = _set_token(adv, token, event, data=data, **{**moved, "state": WAITING, "task_id": task_id,
                                                                "waiting_for": _poll_label(node, 1)})  # fmt: skip
            _insert_task(adv, rows)
            return token
        if kind == "timer":
            fire_at = _timer_fire_at(adv, node_id, node)
            if fire_at <= adv.now:  # a past time fires at once
                token = _set_token(adv, token, event, data=data, state=ACTIVE, **moved)
                event, data, node_id = "timer_fired", {"fire_at": fire_at.isoformat()}, node["next"]
                continue
            token = _set_token(adv, token, event, data=data, **{**moved, "state": WAITING, "waiting_for": "timer",
                                                                "fire_at": fire_at})  # fmt: skip
            _insert_timer(adv, token, "timer", fire_at)
            return token
        if kind == "signal":
            name = node["signal"]
            signal = _oldest_signal(adv, name)
            if signal is not None:
                token = _set_token(adv, token, event, data=data, state=ACTIVE, **moved)
                _consume_signal(adv, token, signal)
                event, data, node_id = (
                    "signal_received",
                    {"signal": name, "signal_id": signal["id"]},
                    node["next"],
                )
                continue
            timeout = node.get("timeout_seconds")
            timeout_at = adv.now + timedelta(seconds=float(timeout)) if timeout is not None else None
            token = _set_token(adv, token, event, data=data, **{**moved, "state": WAITING,
                                                                "waiting_for": f"signal:{name}", "fire_at": timeout_at})  # fmt: skip
            if timeout_at is not None:
                _insert_timer(adv, token, "signal_timeout", timeout_at)
            return token
        if kind == "parallel":
            branches = list(node["branches"])
            token = _set_token(adv, token, event, data=data, **{**moved, "state": FORKED, "waiting_for": "join",
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
            token = _set_token(adv, token, event, data=data, state=ACTIVE, **moved)
            chosen = _choose(adv, node_id, node)
            event, data, node_id = "chose", {"next": chosen}, chosen
            continue
        if kind == "end":
            status = node.get("status") or COMPLETED
            token = _set_token(adv, token, event, data=data, state=DONE, **moved)
            if token["parent_id"] is not None:
                raise _failure("flow_invalid", node_id, "an end inside a parallel branch")
            output = _render(adv, node_id, node["output"]) if node.get("output") is not None else None
            error = None if status == COMPLETED else {"code": "flow_ended", "node": node_id,
                                                      "message": f"the flow reached end node {node_id!r} ({status})"}  # fmt: skip
            _finish(adv, status, output=output, error=error)
            return token
        raise _failure("flow_invalid", node_id, f"unknown node type {kind!r}")
    raise _failure(
        "flow_loop", node_id, f"more than {_MAX_HOPS} nodes passed without a wait (a cycle of choices?)"
    )


def enter(
    adv: Advance, token: dict[str, Any], node_id: str, *, event: str = "entered", data: Any = None
) -> dict[str, Any]:
    """Move ``token`` onto ``node_id`` and do its work (see :func:`_enter`)."""
    return _enter(adv, token, node_id, event=event, data=data)


def _poll_label(node: Mapping[str, Any], round_: int) -> str:
    return f"poll round {round_} of {node['max_rounds']}"


def _timer_fire_at(adv: Advance, node_id: str, node: Mapping[str, Any]) -> datetime:
    if node.get("seconds") is not None:
        return adv.now + timedelta(seconds=float(node["seconds"]))
    path = node["until"]
    try:
        when = paths.resolve_time(path, _scope_for(adv, path), node=node_id)
    except paths.FlowPathError as exc:
        raise FlowFailure(exc.as_error()) from None
    naive = to_naive_utc(when)
    assert naive is not None
    return naive


def _choose(adv: Advance, node_id: str, node: Mapping[str, Any]) -> str:
    choice = _CHOICES.get(id(node))
    if choice is None or choice[0] is not node:
        choice = _CHOICES[id(node)] = (node, ChoiceNode.model_validate(node))
    return paths.choose(choice[1], _scope_for(adv, node))


#: Parsed choice nodes, by the identity of their (cached, immutable) graph dict.
_CHOICES: dict[int, tuple[Mapping[str, Any], ChoiceNode]] = {}


def _arrive(adv: Advance, token: dict[str, Any], join_id: str, moved: dict[str, Any], event: str,
            data: Any) -> dict[str, Any]:  # fmt: skip
    """A child token arrives at its join: the last arrival moves the parent on (module docstring)."""
    if token["parent_id"] is None:  # a join outside any block: the validator refuses it; pass through
        token = _set_token(adv, token, event, data=data, state=ACTIVE, **moved)
        return _enter(adv, token, adv.nodes[join_id]["next"], event="joined")
    parent = _lock_token(adv.conn, token["parent_id"])
    if parent is None or parent["state"] != FORKED:
        raise errors.ConcurrentUpdate(f"the parent of flow token {token['id']} is not waiting at its join")
    token = _set_token(adv, token, event, data=data, state=ARRIVED, **moved)
    left = int(parent["children_open"]) - 1
    if left > 0:
        _set_token(
            adv, parent, "branch_arrived", data={"child_id": token["id"], "open": left}, children_open=left
        )
        return token
    parent = _set_token(adv, parent, "joined", data={"last_child_id": token["id"]}, children_open=0, state=ACTIVE,
                        node_id=join_id, activation=int(parent["activation"]) + 1, waiting_for=None)  # fmt: skip
    _enter(adv, parent, adv.nodes[join_id]["next"])
    return token


# ------------------------------------------------------------------ tasks


def _prepare_task(adv: Advance, token: Mapping[str, Any], node_id: str, node: Mapping[str, Any], activation: int,
                  *, round_: int) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """Build (reads only) the rows of a step's task; ``(task id, rows)``. An existing task of this key
    (a retried advance) is reused. Raises FlowFailure for a missing path or queue, bad options."""
    inst = adv.instance
    key = f"flow:{inst['id']}:{node_id}:{token['id']}.{activation}" + (f":{round_}" if round_ else "")
    params = _render(adv, node_id, node.get("params", {}))
    template = node.get("concurrency_key")
    try:
        concurrency_key = paths.render_concurrency_key(
            template, _scope_for(adv, template or ""), node=node_id
        )
    except paths.FlowPathError as exc:
        raise FlowFailure(exc.as_error()) from None
    timeout = node.get("timeout_seconds")
    deadline = adv.now + timedelta(seconds=float(timeout)) if timeout is not None else None
    if node["type"] == "poll" and node.get("deadline_seconds") is not None:
        poll_deadline = _poll_started(adv, token, activation) + timedelta(
            seconds=float(node["deadline_seconds"])
        )
        deadline = min(deadline, poll_deadline) if deadline is not None else poll_deadline
    try:
        submission = TaskSubmission(
            queue=node["queue"], handler=node["handler"], params=params,
            options=SubmitOptions(max_attempts=node.get("max_attempts"), retry_safe=node.get("retry_safe"),
                                  deadline=deadline.replace(tzinfo=UTC) if deadline else None,
                                  concurrency_key=concurrency_key),
        )  # fmt: skip
    except ValueError as exc:
        raise _failure("flow_invalid_step", node_id, f"its task is not valid: {exc}") from None
    found = adv.conn.execute(
        store.lookup_statement(adv.conn), {"ns": inst["namespace_id"], "key": key, "queue": submission.queue}
    ).mappings().one()  # fmt: skip
    if found["task_id"] is not None:
        return found["task_id"], {}
    if found["queue_id"] is None:
        raise _failure("queue_not_found", node_id,
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


def _insert_task(adv: Advance, rows: Mapping[str, Any]) -> None:
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


def _poll_started(adv: Advance, token: Mapping[str, Any], activation: int) -> datetime:
    """When the poll's activation started: its first round's creation (rows, never memory: invariant 11)."""
    started = adv.conn.execute(
        sa.select(sa.func.min(flow_steps.c.created_at)).where(
            flow_steps.c.token_id == token["id"], flow_steps.c.activation == activation
        )
    ).scalar()
    return adv.now if started is None else execution._naive(started)


def _insert_timer(
    adv: Advance, token: Mapping[str, Any], kind: str, fire_at: datetime, round_: int = 0
) -> None:
    adv.conn.execute(
        _INSERT_TIMER,
        {"instance_id": token["instance_id"], "token_id": token["id"], "activation": token["activation"],
         "kind": kind, "round": round_, "fire_at": fire_at, "state": PENDING, "created_at": adv.now},
    )  # fmt: skip


# ------------------------------------------------------------------ signals


def _oldest_signal(adv: Advance, name: str) -> dict[str, Any] | None:
    row = adv.conn.execute(
        sa.select(flow_signals.c.id, flow_signals.c.name, flow_signals.c.payload)
        .where(flow_signals.c.instance_id == adv.instance["id"], flow_signals.c.name == name,
               flow_signals.c.consumed_at.is_(None))
        .order_by(flow_signals.c.received_at, flow_signals.c.id)
        .limit(1)
        .with_for_update()
    ).mappings().first()  # fmt: skip
    return dict(row) if row is not None else None


def _consume_signal(adv: Advance, token: Mapping[str, Any], signal: Mapping[str, Any]) -> None:
    done = adv.conn.execute(
        flow_signals.update()
        .where(flow_signals.c.id == signal["id"], flow_signals.c.consumed_at.is_(None))
        .values(consumed_by_token=token["id"], consumed_activation=token["activation"], consumed_at=adv.now)
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"flow signal {signal['id']} was consumed concurrently")
    adv.forget_scope()


def _cancel_timers(adv: Advance, token: Mapping[str, Any], kind: str) -> None:
    adv.conn.execute(
        flow_timers.update()
        .where(flow_timers.c.token_id == token["id"], flow_timers.c.activation == token["activation"],
               flow_timers.c.kind == kind, flow_timers.c.state == PENDING)
        .values(state=CANCELLED, fired_at=adv.now)
    )  # fmt: skip


# ------------------------------------------------------------------ finishing


def _finish(adv: Advance, status: str, *, output: Any = None, error: Any = None, actor: str | None = None,
            reason: str | None = None) -> None:  # fmt: skip
    """End the instance: its status, its live tokens ``CANCELLED``, pending timers ``CANCELLED`` and a
    cancel request for every live step task, in this transaction."""
    conn = adv.conn
    inst = adv.instance
    live = [
        dict(row)
        for row in conn.execute(
            sa.select(flow_tokens)
            .where(flow_tokens.c.instance_id == inst["id"], flow_tokens.c.state.in_(LIVE_TOKENS))
            .order_by(flow_tokens.c.created_at)
            .with_for_update()
        ).mappings()
    ]
    # An ARRIVED token is finished once its join passed (its parent moved on); it waits only while
    # its parent is still FORKED.
    forked = {t["id"] for t in live if t["state"] == FORKED}
    live = [t for t in live if t["state"] != ARRIVED or t["parent_id"] in forked]
    for token in live:
        _set_token(adv, token, "cancelled", state=CANCELLED, waiting_for=None, fire_at=None)
    conn.execute(
        flow_timers.update()
        .where(flow_timers.c.instance_id == inst["id"], flow_timers.c.state == PENDING)
        .values(state=CANCELLED, fired_at=adv.now)
    )
    task_ids = [t["task_id"] for t in live if t["task_id"] is not None]
    if task_ids:
        open_tasks = conn.execute(
            sa.select(tasks.c.id).where(
                tasks.c.id.in_(task_ids),
                tasks.c.status.in_([TaskStatus.WAITING.value, TaskStatus.LEASED.value, TaskStatus.RUNNING.value]),
            )
        ).scalars().all()  # fmt: skip
        why = reason or f"flow instance {inst['id']} is {status}"
        for task_id in open_tasks:
            execution.cancel_task(conn, inst["namespace_id"], task_id, reason=why, actor=actor or adv.actor)
    event = {COMPLETED: "instance_completed", FAILED: "instance_failed", CANCELLED: "instance_cancelled"}[
        status
    ]
    _set_instance(adv, event, data={"reason": reason} if reason else None, actor=actor, status=status, paused=False,
                  output=output, error=error, finished_at=adv.now,
                  **({"control_version": int(inst["control_version"]) + 1} if status == CANCELLED else {}))  # fmt: skip


finish = _finish
set_instance = _set_instance


def _fail(adv: Advance, error: dict[str, Any]) -> None:
    log.info("flow instance failed instance_id=%s node=%s type=%s", adv.instance["id"], error.get("node"),
             error.get("type"))  # fmt: skip
    _finish(adv, FAILED, error=error)


def guarded(adv: Advance, work: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``work(*args, **kwargs)``; a :class:`FlowFailure` fails the instance in this transaction instead.

    Every step raises FlowFailure before it writes anything of its own (its reads decide first), so what
    was written before it (earlier nodes passed) is true history, and failing the instance re-reads the
    tokens it cancels.
    """
    try:
        return work(*args, **kwargs)
    except FlowFailure as exc:
        adv.forget_scope()
        _fail(adv, exc.error)
        return None


# ------------------------------------------------------------------ units of work


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one unit of work did: ``outcome`` (applied, stale, deferred, none) and tasks created."""

    outcome: str
    created_tasks: int = 0


def _done(adv: Advance, outcome: str) -> Outcome:
    adv.flush()
    ADVANCES.labels(outcome).inc()
    return Outcome(outcome, adv.created_tasks)


def enter_token(conn: Connection, token_id: str, settings: EngineSettings) -> Outcome:
    """Do the entry of an ``ACTIVE`` token (a fork's child, a token whose entry a crash interrupted)."""
    instance_id = conn.execute(
        sa.select(flow_tokens.c.instance_id).where(flow_tokens.c.id == token_id)
    ).scalar()
    if instance_id is None:
        return Outcome("none")
    adv = begin(conn, instance_id, settings)
    if adv is None or not _runnable(adv):
        return Outcome("deferred" if adv is not None and adv.instance["status"] == PAUSED else "none")
    token = _lock_token(conn, token_id)
    if token is None or token["state"] != ACTIVE:
        return Outcome("none")
    _faults.flow_point("claimed")
    # An ACTIVE token sits on node_id with its entry not done: entering it is its next activation.
    guarded(adv, _enter, adv, token, token["node_id"])
    return _done(adv, "applied")


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
    token = _lock_token(conn, event["token_id"])
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
        return _done(adv, "stale")
    assert token is not None
    guarded(adv, _apply_result, adv, token, event)
    return _done(adv, "applied")


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
        _set_token(adv, token, "task_needs_review", data=data, waiting_for="review")
        return
    if node["type"] == "poll":
        _poll_round_done(adv, token, node_id, node, status, result, data)
        return
    if status is TaskStatus.SUCCEEDED:
        _enter(adv, token, node["next"], event="task_succeeded", data=data)
    elif node.get("on_failure"):
        _enter(adv, token, node["on_failure"], event="task_failed", data=data)
    else:
        raise _failure("step_failed", node_id, f"its task {event['task_id']} ended {status.value}",
                       task_id=event["task_id"], status=status.value, task_error=error)  # fmt: skip


def _poll_round_done(adv: Advance, token: dict[str, Any], node_id: str, node: Mapping[str, Any], status: TaskStatus,
                     result: Any, data: dict[str, Any]) -> None:  # fmt: skip
    if status is TaskStatus.SUCCEEDED and paths.poll_done(node["done_path"], result):
        _enter(adv, token, node["next"], event="poll_done", data=data)
        return
    rounds = int(adv.conn.execute(
        sa.select(sa.func.count()).select_from(flow_steps)
        .where(flow_steps.c.token_id == token["id"], flow_steps.c.activation == token["activation"])
    ).scalar_one())  # fmt: skip
    next_at = adv.now + timedelta(seconds=float(node["interval_seconds"]))
    spent = rounds >= int(node["max_rounds"])
    if not spent and node.get("deadline_seconds") is not None:
        started = _poll_started(adv, token, int(token["activation"]))
        spent = next_at > started + timedelta(seconds=float(node["deadline_seconds"]))
    data = {**data, "rounds": rounds}
    if spent:
        if node.get("on_exhausted"):
            _enter(adv, token, node["on_exhausted"], event="poll_exhausted", data=data)
            return
        raise _failure("poll_exhausted", node_id, f"the poll spent its budget ({rounds} rounds) without being done",
                       rounds=rounds)  # fmt: skip
    token = _set_token(adv, token, "poll_round_finished", data=data, task_id=None, fire_at=next_at,
                       waiting_for=_poll_label(node, rounds + 1))  # fmt: skip
    _insert_timer(adv, token, "poll_round", next_at, round_=rounds + 1)


def fire_timer(conn: Connection, timer_id: int, settings: EngineSettings) -> Outcome:
    """Fire one due timer: claimed with ``SKIP LOCKED`` plus a conditional update, so of two servers
    exactly one fires it; a paused instance's timer waits for the resume (invariant 12)."""
    timer = conn.execute(sa.select(flow_timers).where(flow_timers.c.id == timer_id)).mappings().first()
    if timer is None or timer["state"] != PENDING:
        return Outcome("none")
    adv = begin(conn, timer["instance_id"], settings)
    if adv is None or not _runnable(adv):
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
    token = _lock_token(conn, timer["token_id"])
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
        return _done(adv, "stale")
    assert token is not None
    guarded(adv, _timer_fired, adv, token, dict(timer))
    return _done(adv, "applied")


def _timer_fired(adv: Advance, token: dict[str, Any], timer: Mapping[str, Any]) -> None:
    node_id = token["node_id"]
    node = adv.nodes[node_id]
    data = {"timer_id": timer["id"], "kind": timer["kind"]}
    if timer["kind"] == "timer":
        _enter(adv, token, node["next"], event="timer_fired", data=data)
    elif timer["kind"] == "signal_timeout":
        _enter(adv, token, node["on_timeout"], event="signal_timed_out", data=data)
    else:
        round_ = int(timer["round"])
        task_id, rows = _prepare_task(adv, token, node_id, node, int(token["activation"]), round_=round_)
        _set_token(adv, token, "poll_round_started", data={**data, "round": round_}, task_id=task_id, fire_at=None,
                   waiting_for=_poll_label(node, round_))  # fmt: skip
        _insert_task(adv, rows)


def match_signal(conn: Connection, token_id: str, settings: EngineSettings) -> Outcome:
    """Give a waiting signal token the oldest buffered signal of its name, if any (after a resume)."""
    instance_id = conn.execute(
        sa.select(flow_tokens.c.instance_id).where(flow_tokens.c.id == token_id)
    ).scalar()
    if instance_id is None:
        return Outcome("none")
    adv = begin(conn, instance_id, settings, exclusive=True)
    if adv is None or not _runnable(adv):
        return Outcome("none")
    token = _lock_token(conn, token_id)
    if token is None or token["state"] != WAITING or not str(token["waiting_for"]).startswith("signal:"):
        return Outcome("none")
    if not deliver_signal(adv, token):
        return Outcome("none")
    return _done(adv, "applied")


def deliver_signal(adv: Advance, token: dict[str, Any]) -> bool:
    """If a signal of the name ``token`` waits for is buffered, consume the oldest and move the token on."""
    name = str(token["waiting_for"]).removeprefix("signal:")
    signal = _oldest_signal(adv, name)
    if signal is None:
        return False
    _consume_signal(adv, token, signal)
    _cancel_timers(adv, token, "signal_timeout")
    node = adv.nodes[token["node_id"]]
    guarded(adv, _enter, adv, token, node["next"], event="signal_received",
            data={"signal": name, "signal_id": signal["id"]})  # fmt: skip
    return True
