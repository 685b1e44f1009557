"""One transaction's view of a flow instance, and what every advance shares: the locked instance row, its
graph and the clock, the conditional updates of tokens and of the instance with their history rows, and
how an instance ends (README "Flows: running them"; seed 002 §4-§8). The rules are in :mod:`.engine`."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from prometheus_client import Counter
from sqlalchemy.engine import Connection

from orbit_client import TaskStatus
from orbit_server import errors
from orbit_server.db import faults as _faults
from orbit_server.db import flow_hooks
from orbit_server.db.schema import (
    flow_definitions,
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
from orbit_server.flows import paths
from orbit_server.tasks import operations, transitions

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


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What step tasks inherit from the server's settings.

    ``max_value_bytes``: the largest rendered template (a step's params, an end's output), in bytes of
    compact UTF-8 JSON: the server's ``ORBIT_MAX_BODY_BYTES``, so a flow stores nothing a client could
    not have sent (a template may repeat a path: ten copies of a large result).
    """

    default_max_attempts: int = 3
    key_ttl: timedelta = timedelta(days=7)
    max_value_bytes: int = 256 * 1024


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
_INSERT_TASK_EVENT = transitions._INSERT_EVENT
_GRAPH = sa.select(flow_versions.c.graph).where(flow_versions.c.id == sa.bindparam("id"))
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
            transitions._clock(conn).label("db_now"),
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
    actor: str = FLOW_ACTOR
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
        self.conn.info[flow_hooks.WROTE_EVENT] = True

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
          actor: str = FLOW_ACTOR) -> Advance | None:  # fmt: skip
    """Lock the instance (shared, or exclusive) and read it, its graph and the clock; ``None`` if absent."""
    row = conn.execute(_instance_statement(conn, exclusive=exclusive), {"id": instance_id}).mappings().first()
    if row is None:
        return None
    instance = dict(row)
    now = transitions._naive(instance.pop("db_now"))
    return Advance(conn, instance, load_graph(conn, instance["version_id"]), now, settings, actor=actor)


def runnable(adv: Advance) -> bool:
    return adv.instance["status"] == RUNNING and not adv.instance["paused"]


def lock_token(conn: Connection, token_id: str) -> dict[str, Any] | None:
    row = conn.execute(_LOCK_TOKEN, {"id": token_id}).mappings().first()
    return dict(row) if row is not None else None


def set_token(adv: Advance, token: dict[str, Any], event: str, *, data: Any = None,
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


def set_instance(
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


def scope_for(adv: Advance, template: Any) -> Mapping[str, Any]:
    """The scope a template or path needs: steps and signals are read only when it refers to them."""
    if adv._scope is not None:
        return adv._scope
    text = template if isinstance(template, str) else json.dumps(template)
    if "$.steps" in text or "$.signals" in text:
        return adv.scope()
    inst = adv.instance
    return paths.make_scope(input=inst["input"], instance_id=inst["id"], flow=inst["flow_name"],
                            version=inst["version_number"])  # fmt: skip


def render(adv: Advance, node_id: str, template: Any) -> Any:
    """``template`` rendered for ``node_id``. Raises FlowFailure: a path is missing, or the value is larger
    than ``settings.max_value_bytes`` (code ``flow_value_too_large``)."""
    try:
        value = paths.render(template, scope_for(adv, template), node=node_id)
    except paths.FlowPathError as exc:
        raise FlowFailure(exc.as_error()) from None
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > adv.settings.max_value_bytes:
        raise failure("flow_value_too_large", node_id,
                      f"its rendered template is {size} bytes, more than the limit of {adv.settings.max_value_bytes} "
                      "(ORBIT_MAX_BODY_BYTES)", size=size, limit=adv.settings.max_value_bytes)  # fmt: skip
    return value


def failure(code: str, node_id: str, message: str, **extra: Any) -> FlowFailure:
    """An instance error in the shape of :meth:`paths.FlowPathError.as_error`: code, message, node."""
    return FlowFailure({"code": code, "message": f"node {node_id!r}: {message}", "node": node_id, **extra})


# ------------------------------------------------------------------ finishing


def finish(adv: Advance, status: str, *, output: Any = None, error: Any = None, actor: str | None = None,
           reason: str | None = None, control: bool = False) -> None:  # fmt: skip
    """End the instance: its status, its live tokens ``CANCELLED``, pending timers ``CANCELLED`` and a
    cancel request for every live step task, in this transaction. ``control``: a cancel through the API,
    which bumps ``control_version`` too."""
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
        set_token(adv, token, "cancelled", state=CANCELLED, waiting_for=None, fire_at=None)
    conn.execute(
        flow_timers.update()
        .where(flow_timers.c.instance_id == inst["id"], flow_timers.c.state == PENDING)
        .values(state=CANCELLED, fired_at=adv.now)
    )
    task_ids = [t["task_id"] for t in live if t["task_id"] is not None]
    if task_ids:
        # A locking read: the newest committed status (a completion that commits meanwhile is waited
        # for, then seen), so a task that just finished is not asked to cancel (a 409 for the instance).
        open_tasks = conn.execute(
            sa.select(tasks.c.id).where(
                tasks.c.id.in_(task_ids),
                tasks.c.status.in_([TaskStatus.WAITING.value, TaskStatus.LEASED.value, TaskStatus.RUNNING.value]),
            ).order_by(tasks.c.id).with_for_update()
        ).scalars().all()  # fmt: skip
        why = reason or f"flow instance {inst['id']} is {status}"
        for task_id in open_tasks:
            operations.cancel_task(conn, inst["namespace_id"], task_id, reason=why, actor=actor or adv.actor)
    event = {COMPLETED: "instance_completed", FAILED: "instance_failed", CANCELLED: "instance_cancelled"}[
        status
    ]
    set_instance(adv, event, data={"reason": reason} if reason else None, actor=actor, status=status, paused=False,
                  output=output, error=error, finished_at=adv.now,
                  **({"control_version": int(inst["control_version"]) + 1} if control else {}))  # fmt: skip


def fail(adv: Advance, error: dict[str, Any]) -> None:
    log.info("flow instance failed instance_id=%s node=%s code=%s", adv.instance["id"], error.get("node"),
             error.get("code"))  # fmt: skip
    finish(adv, FAILED, error=error)


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
        fail(adv, exc.error)
        return None


# ------------------------------------------------------------------ units of work


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one unit of work did: ``outcome`` (applied, stale, deferred, none) and tasks created."""

    outcome: str
    created_tasks: int = 0


def done(adv: Advance, outcome: str) -> Outcome:
    adv.flush()
    ADVANCES.labels(outcome).inc()
    return Outcome(outcome, adv.created_tasks)
