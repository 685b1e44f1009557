"""Flow definitions, versions and instances: publishing, starting and reading (README "Flows: running them").

Each function takes the caller's connection and does one short unit of work; run it with
:func:`orbit_server.db.transact.transact`. The views (:func:`get_instance`, ...) build the wire models
of :mod:`orbit_client._flow_models`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from orbit_client import (
    FlowGraph,
    FlowHistoryEntry,
    FlowHistoryPage,
    FlowInstance,
    FlowInstancePage,
    FlowInstanceStatus,
    FlowPublish,
    FlowStart,
    FlowStep,
    FlowSummary,
    FlowToken,
    FlowTokenState,
    FlowVersion,
    TaskStatus,
    canonical_graph,
    canonical_graph_digest,
)
from orbit_server import _ids, errors
from orbit_server.db.engine import BIGINT_MAX, INTEGER_MAX, as_db_time, db_now, db_now_expression, to_utc
from orbit_server.db.schema import (
    flow_definitions,
    flow_events,
    flow_history,
    flow_instances,
    flow_start_tombstones,
    flow_steps,
    flow_tokens,
    flow_versions,
    tasks,
)
from orbit_server.flows import engine
from orbit_server.tasks.store import Principal

__all__ = [
    "actor_of",
    "find_start",
    "get_instance",
    "get_version",
    "history",
    "list_flows",
    "list_instances",
    "list_versions",
    "publish",
    "start",
    "start_digest",
]


def actor_of(principal: Principal, actor: str | None = None) -> str:
    """Who did it, for the audit: the actor named in the request, and the API key (``orbit-server cli`` for
    the command line's principal, key id 0, as in :mod:`orbit_server.schedules.schedules`)."""
    key = f"api_key:{principal.key_id}" if principal.key_id else "orbit-server cli"
    return f"{actor} ({key})" if actor else key


def _at(value: datetime) -> datetime:
    aware = to_utc(value)
    assert aware is not None
    return aware


# ------------------------------------------------------------------ definitions and versions


def _definition(conn: Connection, namespace_id: int, name: str, *, lock: bool = False) -> RowMapping | None:
    query = sa.select(flow_definitions).where(
        flow_definitions.c.namespace_id == namespace_id, flow_definitions.c.name == name
    )
    return conn.execute(query.with_for_update() if lock else query).mappings().first()


def _version_model(namespace: str, flow: str, row: RowMapping) -> FlowVersion:
    return FlowVersion(
        namespace=namespace, flow=flow, version=row["version"], digest=row["digest"],
        graph=FlowGraph.model_validate(row["graph"]), description=row["description"],
        published_at=_at(row["published_at"]), published_by=row["published_by"],
    )  # fmt: skip


def publish(conn: Connection, principal: Principal, name: str, body: FlowPublish) -> tuple[FlowVersion, bool]:
    """Publish a version of flow ``name`` (created on first publish), or find the same graph's version.

    The graph is stored in canonical form with its digest (:func:`orbit_client.canonical_graph`);
    versions are numbered 1, 2, ... under the definition's row lock, and never change. The
    publication is audited in the version row (``published_at``, ``published_by``).

    Returns:
        ``(version, created)``: ``created`` is ``False`` when a version with the same digest existed.

    Raises:
        sqlalchemy.exc.IntegrityError: a concurrent first publish of the same flow won (retry).
    """
    now = db_now(conn)
    graph = canonical_graph(body.graph)
    digest = canonical_graph_digest(body.graph)
    definition = _definition(conn, principal.namespace_id, name, lock=True)
    if definition is None:
        conn.execute(
            flow_definitions.insert().values(
                namespace_id=principal.namespace_id,
                name=name,
                latest_version=0,
                created_at=now,
                updated_at=now,
            )
        )
        definition = _definition(conn, principal.namespace_id, name, lock=True)
        assert definition is not None
    found = conn.execute(
        sa.select(flow_versions).where(
            flow_versions.c.definition_id == definition["id"], flow_versions.c.digest == digest
        )
    ).mappings().first()  # fmt: skip
    if found is not None:
        return _version_model(principal.namespace, name, found), False
    number = int(definition["latest_version"]) + 1
    conn.execute(
        flow_versions.insert().values(
            definition_id=definition["id"], version=number, graph=graph, digest=digest,
            description=body.description, published_at=now, published_by=actor_of(principal),
        )
    )  # fmt: skip
    done = conn.execute(
        flow_definitions.update()
        .where(flow_definitions.c.id == definition["id"], flow_definitions.c.latest_version == number - 1)
        .values(latest_version=number, updated_at=now)
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"flow {name!r} was published concurrently")
    row = conn.execute(
        sa.select(flow_versions).where(
            flow_versions.c.definition_id == definition["id"], flow_versions.c.version == number
        )
    ).mappings().one()  # fmt: skip
    return _version_model(principal.namespace, name, row), True


def _flow_missing(principal: Principal, name: str) -> errors.FlowNotFound:
    return errors.FlowNotFound(
        f"flow {name!r} does not exist in namespace {principal.namespace!r}; publish a version first"
    )


def list_flows(conn: Connection, principal: Principal) -> list[FlowSummary]:
    """The namespace's flows, by name."""
    rows = conn.execute(
        sa.select(flow_definitions)
        .where(flow_definitions.c.namespace_id == principal.namespace_id)
        .order_by(flow_definitions.c.name)
    ).mappings()
    return [
        FlowSummary(namespace=principal.namespace, name=row["name"], latest_version=row["latest_version"],
                    created_at=_at(row["created_at"]), updated_at=_at(row["updated_at"]))
        for row in rows
    ]  # fmt: skip


def list_versions(conn: Connection, principal: Principal, name: str) -> list[FlowVersion]:
    """A flow's versions, newest first. Raises FlowNotFound."""
    definition = _definition(conn, principal.namespace_id, name)
    if definition is None:
        raise _flow_missing(principal, name)
    rows = conn.execute(
        sa.select(flow_versions)
        .where(flow_versions.c.definition_id == definition["id"])
        .order_by(flow_versions.c.version.desc())
    ).mappings()
    return [_version_model(principal.namespace, name, row) for row in rows]


def get_version(conn: Connection, principal: Principal, name: str, version: int) -> FlowVersion:
    """One version. Raises FlowNotFound, FlowVersionNotFound."""
    definition = _definition(conn, principal.namespace_id, name)
    if definition is None:
        raise _flow_missing(principal, name)
    if version > INTEGER_MAX:  # no such version (PostgreSQL refuses the parameter: out of range)
        raise errors.FlowVersionNotFound(f"flow {name!r} has no version {version}")
    row = conn.execute(
        sa.select(flow_versions).where(
            flow_versions.c.definition_id == definition["id"], flow_versions.c.version == version
        )
    ).mappings().first()  # fmt: skip
    if row is None:
        raise errors.FlowVersionNotFound(f"flow {name!r} has no version {version}")
    return _version_model(principal.namespace, name, row)


# ------------------------------------------------------------------ starting


def start_digest(flow: str, body: FlowStart) -> str:
    """SHA-256 (hex) of the canonical JSON of a start request: the flow, the version asked for, the input."""
    text = json.dumps({"flow": flow, **body.canonical_meaning()}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)  # fmt: skip
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def find_start(conn: Connection, principal: Principal, key: str, digest: str) -> str | None:
    """The instance an earlier start with ``key`` created, or ``None``. Raises IdempotencyConflict when
    that start had another digest, FlowInstancePurged (410) when its instance was purged."""
    found = conn.execute(
        sa.select(flow_instances.c.id, flow_instances.c.request_digest).where(
            flow_instances.c.namespace_id == principal.namespace_id, flow_instances.c.idempotency_key == key
        )
    ).first()  # fmt: skip
    if found is None:
        tomb = conn.execute(
            sa.select(flow_start_tombstones.c.instance_id, flow_start_tombstones.c.request_digest).where(
                flow_start_tombstones.c.namespace_id == principal.namespace_id,
                flow_start_tombstones.c.idempotency_key == key,
            )
        ).first()
        if tomb is not None:
            _refuse_purged(str(tomb.instance_id), tomb.request_digest, digest)
        return None
    if found.request_digest != digest:
        raise _conflict(str(found.id))
    return str(found.id)


def _refuse_purged(instance_id: str, started_digest: str, digest: str) -> None:
    """A start whose key names a purged instance: 409 for another request, else 410 (never a new one)."""
    if started_digest != digest:
        raise _conflict(instance_id)
    raise errors.FlowInstancePurged(
        f"this Idempotency-Key started instance {instance_id}, which has finished and was purged "
        '(README "Retention and the key window"); it is not started again',
        instance_id=instance_id,
    )


def _conflict(instance_id: str) -> errors.IdempotencyConflict:
    """409: the key's instance (named, so the caller can look at it) was started by another request."""
    return errors.IdempotencyConflict(
        f"this Idempotency-Key already started instance {instance_id} with another flow, version or input; "
        "use a new key for a new instance"
    )


#: :func:`start`'s look-up, built once per dialect: the clock, the key's instance and digest, the flow
#: and the version asked for (``:version`` NULL: the newest), in one round trip of scalar subqueries.
_START_LOOKUP: dict[str, sa.Select[Any]] = {}


def _start_lookup(conn: Connection) -> sa.Select[Any]:
    statement = _START_LOOKUP.get(conn.dialect.name)
    if statement is None:
        i, d, v, t = flow_instances, flow_definitions, flow_versions, flow_start_tombstones
        ns, name = sa.bindparam("ns", type_=sa.BigInteger), sa.bindparam("name", type_=sa.String)
        asked = sa.bindparam("version", type_=sa.Integer)
        key = sa.bindparam("key", type_=sa.String)
        is_key = sa.and_(i.c.namespace_id == ns, i.c.idempotency_key == key)
        is_tomb = sa.and_(t.c.namespace_id == ns, t.c.idempotency_key == key)
        is_flow = sa.and_(d.c.namespace_id == ns, d.c.name == name)
        built: sa.Select[Any] = sa.select(
            db_now_expression(conn.dialect).label("now"),
            sa.select(i.c.id).where(is_key).scalar_subquery().label("instance_id"),
            sa.select(i.c.request_digest).where(is_key).scalar_subquery().label("request_digest"),
            sa.select(t.c.instance_id).where(is_tomb).scalar_subquery().label("purged_id"),
            sa.select(t.c.request_digest).where(is_tomb).scalar_subquery().label("purged_digest"),
            sa.select(d.c.id).where(is_flow).scalar_subquery().label("definition_id"),
            sa.select(d.c.latest_version).where(is_flow).scalar_subquery().label("latest_version"),
            sa.select(v.c.id)
            .select_from(v.join(d, d.c.id == v.c.definition_id))
            .where(is_flow, v.c.version == sa.func.coalesce(asked, d.c.latest_version))
            .scalar_subquery()
            .label("version_id"),
        )
        statement = _START_LOOKUP[conn.dialect.name] = built
    return statement


def start(
    conn: Connection, principal: Principal, name: str, body: FlowStart, key: str, settings: engine.EngineSettings,
    *, traceparent: str | None = None,
) -> tuple[str, bool, engine.Outcome]:  # fmt: skip
    """Start an instance of flow ``name`` once per ``(namespace, key)`` (a repeat is a replay).

    One transaction inserts the instance (bound to the newest or the named version for life,
    invariant 10), its root token and their history, and enters the start node (a task node's task is
    created here, invariant 9).

    Returns:
        ``(instance id, replayed, outcome)``.

    Raises:
        errors.IdempotencyConflict: the key started an instance with another request (409).
        errors.FlowInstancePurged: the key started an instance that was purged since (410).
        errors.FlowNotFound, errors.FlowVersionNotFound: 404.
        sqlalchemy.exc.IntegrityError: a concurrent start with the same key committed first.
    """
    if body.version is not None and body.version > INTEGER_MAX:  # no such version (PostgreSQL: out of range)
        raise errors.FlowVersionNotFound(f"flow {name!r} has no version {body.version}")
    digest = start_digest(name, body)
    found = conn.execute(_start_lookup(conn), {"ns": principal.namespace_id, "key": key, "name": name,
                                               "version": body.version}).mappings().one()  # fmt: skip
    if found["instance_id"] is not None:
        if found["request_digest"] != digest:
            raise _conflict(str(found["instance_id"]))
        return found["instance_id"], True, engine.Outcome("none")
    if found["purged_id"] is not None:
        _refuse_purged(str(found["purged_id"]), found["purged_digest"], digest)
    if found["definition_id"] is None:
        raise _flow_missing(principal, name)
    if found["version_id"] is None:
        raise errors.FlowVersionNotFound(f"flow {name!r} has no version {body.version}")
    version_id, number = int(found["version_id"]), int(body.version or found["latest_version"])
    now = as_db_time(found["now"])
    instance_id = str(uuid.uuid4())
    row = {
        "id": instance_id, "namespace_id": principal.namespace_id, "definition_id": found["definition_id"],
        "version_id": version_id, "input": body.input, "status": engine.RUNNING, "paused": False,
        "control_version": 1, "state_version": 1, "output": None, "error": None, "idempotency_key": key,
        "request_digest": digest, "created_by": actor_of(principal), "created_at": now, "updated_at": now,
        "finished_at": None, "traceparent": traceparent,
    }  # fmt: skip
    conn.execute(flow_instances.insert(), row)
    graph = engine.load_graph(conn, version_id)
    token = {
        "id": str(uuid.uuid4()), "instance_id": instance_id, "node_id": graph["start"], "state": engine.ACTIVE,
        "activation": 0, "version": 1, "parent_id": None, "children_open": 0, "task_id": None,
        "waiting_for": None, "fire_at": None, "created_at": now, "updated_at": now,
    }  # fmt: skip
    conn.execute(flow_tokens.insert(), token)
    instance = {**row, "ns_name": principal.namespace, "flow_name": name, "version_number": number}
    adv = engine.Advance(conn, instance, graph, now, settings, actor=actor_of(principal))
    adv.record("instance_started", to_state=engine.RUNNING, data={"version": number})
    adv.record("token_created", token, to_state=engine.ACTIVE)
    adv.actor = engine.FLOW_ACTOR
    engine.guarded(adv, engine.enter, adv, token, graph["start"])
    adv.flush()
    return instance_id, False, engine.Outcome("applied", adv.created_tasks)


# ------------------------------------------------------------------ reading instances


def _instance_query() -> sa.Select[Any]:
    return sa.select(
        flow_instances,
        sa.select(flow_definitions.c.name)
        .where(flow_definitions.c.id == flow_instances.c.definition_id)
        .scalar_subquery()
        .label("flow_name"),
        sa.select(flow_versions.c.version)
        .where(flow_versions.c.id == flow_instances.c.version_id)
        .scalar_subquery()
        .label("version_number"),
    )


def _views(conn: Connection, namespace: str, rows: Sequence[RowMapping]) -> list[FlowInstance]:
    """The wire models of instance rows, with tokens, steps and pending events (three statements)."""
    if not rows:
        return []
    ids = [row["id"] for row in rows]
    token_rows: dict[str, list[RowMapping]] = {i: [] for i in ids}
    for token in conn.execute(
        sa.select(flow_tokens).where(flow_tokens.c.instance_id.in_(ids)).order_by(flow_tokens.c.created_at)
    ).mappings():
        token_rows[token["instance_id"]].append(token)
    step_rows: dict[str, list[FlowStep]] = {i: [] for i in ids}
    s = flow_steps
    for step in conn.execute(
        sa.select(s, tasks.c.status.label("task_status"), tasks.c.result.label("task_result"),
                  tasks.c.error.label("task_error"), tasks.c.finished_at.label("task_finished_at"))
        .select_from(s.outerjoin(tasks, tasks.c.id == s.c.task_id))
        .where(s.c.instance_id.in_(ids))
        .order_by(s.c.id)
    ).mappings():  # fmt: skip
        status = step["task_status"] or step["status"] or TaskStatus.WAITING.value
        purged = step["task_status"] is None
        step_rows[step["instance_id"]].append(
            FlowStep(
                node=step["node_id"], activation=step["activation"], token_id=step["token_id"],
                task_id=step["task_id"], status=TaskStatus(status),
                result=step["result"] if purged else step["task_result"],
                error=step["error"] if purged else step["task_error"],
                round=step["round"] or None, created_at=_at(step["created_at"]),
                finished_at=to_utc(step["finished_at"] if purged else step["task_finished_at"]),
            )
        )  # fmt: skip
    pending: dict[str, int] = {
        instance_id: int(n)
        for instance_id, n in conn.execute(
            sa.select(flow_events.c.instance_id, sa.func.count())
            .where(flow_events.c.instance_id.in_(ids), flow_events.c.consumed_at.is_(None))
            .group_by(flow_events.c.instance_id)
        )
    }
    out = []
    for row in rows:
        toks = token_rows[row["id"]]
        out.append(
            FlowInstance(
                id=row["id"], namespace=namespace, flow=row["flow_name"], version=row["version_number"],
                status=FlowInstanceStatus(row["status"]), paused=bool(row["paused"]), input=row["input"],
                output=row["output"], error=row["error"], idempotency_key=row["idempotency_key"],
                control_version=row["control_version"],
                # Bumped by every change of the instance (its state_version) or of a token (its version).
                state_version=int(row["state_version"]) + sum(int(t["version"]) - 1 for t in toks),
                # Likewise the newest change of the instance or of any of its tokens (issue 23: a token's
                # move left "updated" where the start put it).
                created_at=_at(row["created_at"]),
                updated_at=_at(max([row["updated_at"], *(t["updated_at"] for t in toks)])),
                finished_at=to_utc(row["finished_at"]),
                tokens=[
                    FlowToken(id=t["id"], node=t["node_id"], state=FlowTokenState(t["state"]),
                              activation=t["activation"], parent_id=t["parent_id"], task_id=t["task_id"],
                              waiting_for=t["waiting_for"], fire_at=to_utc(t["fire_at"]))
                    for t in toks
                ],
                steps=step_rows[row["id"]], pending_events=int(pending.get(row["id"], 0)),
            )
        )  # fmt: skip
    return out


def _missing(instance_id: str) -> errors.FlowInstanceNotFound:
    return errors.FlowInstanceNotFound(f"no flow instance {instance_id!r} in this namespace")


def get_instance(conn: Connection, principal: Principal, instance_id: str) -> FlowInstance:
    """One instance with its tokens and steps. Raises FlowInstanceNotFound."""
    if not _ids.can_exist(instance_id):
        raise _missing(instance_id)
    row = conn.execute(
        _instance_query().where(
            flow_instances.c.id == instance_id, flow_instances.c.namespace_id == principal.namespace_id
        )
    ).mappings().first()  # fmt: skip
    if row is None:
        raise _missing(instance_id)
    return _views(conn, principal.namespace, [row])[0]


def check_instance(conn: Connection, principal: Principal, instance_id: str) -> None:
    """Raise FlowInstanceNotFound unless the instance exists in the caller's namespace."""
    if not _ids.can_exist(instance_id) or conn.execute(
        sa.select(flow_instances.c.id).where(
            flow_instances.c.id == instance_id, flow_instances.c.namespace_id == principal.namespace_id
        )
    ).first() is None:  # fmt: skip
        raise _missing(instance_id)


def _encode(*parts: Any) -> str:
    raw = json.dumps(list(parts), separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _decode(cursor: str, size: int) -> list[Any]:
    try:
        parts = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(parts, list) or len(parts) != size:
            raise ValueError("not a cursor")
        return parts
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise errors.InvalidCursor("pass back the cursor of an earlier page unchanged") from exc


def list_instances(
    conn: Connection, principal: Principal, *, flow: str | None = None, status: FlowInstanceStatus | None = None,
    idempotency_key: str | None = None, cursor: str | None = None, limit: int = 50,
) -> FlowInstancePage:  # fmt: skip
    """A page of the namespace's instances, newest first (by ``created_at``, then id)."""
    i = flow_instances
    query = _instance_query().where(i.c.namespace_id == principal.namespace_id)
    if flow is not None:
        query = query.where(
            i.c.definition_id
            == sa.select(flow_definitions.c.id)
            .where(flow_definitions.c.namespace_id == principal.namespace_id, flow_definitions.c.name == flow)
            .scalar_subquery()
        )
    if status is not None:
        query = query.where(i.c.status == status.value)
    if idempotency_key is not None:
        if not idempotency_key.isascii():
            return FlowInstancePage(items=[], next_cursor=None)
        query = query.where(i.c.idempotency_key == idempotency_key)
    if cursor is not None:
        created, after_id = _decode(cursor, 2)
        try:
            before = datetime.fromisoformat(created)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidCursor("pass back the cursor of an earlier page unchanged") from exc
        if not isinstance(after_id, str) or not _ids.can_exist(after_id):
            raise errors.InvalidCursor("pass back the cursor of an earlier page unchanged")
        query = query.where(
            sa.or_(i.c.created_at < before, sa.and_(i.c.created_at == before, i.c.id < after_id))
        )
    rows = (
        conn.execute(query.order_by(i.c.created_at.desc(), i.c.id.desc()).limit(limit + 1)).mappings().all()
    )
    page = rows[:limit]
    next_cursor = _encode(page[-1]["created_at"].isoformat(), page[-1]["id"]) if len(rows) > limit else None
    return FlowInstancePage(items=_views(conn, principal.namespace, page), next_cursor=next_cursor)


def history(
    conn: Connection, principal: Principal, instance_id: str, *, cursor: str | None = None, limit: int = 100
) -> FlowHistoryPage:
    """A page of an instance's history, oldest first. Raises FlowInstanceNotFound, InvalidCursor."""
    check_instance(conn, principal, instance_id)
    h = flow_history
    query = sa.select(h).where(h.c.instance_id == instance_id)
    if cursor is not None:
        (after,) = _decode(cursor, 1)
        if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= BIGINT_MAX:
            raise errors.InvalidCursor("pass back the cursor of an earlier page unchanged")
        query = query.where(h.c.id > after)
    rows = conn.execute(query.order_by(h.c.id).limit(limit + 1)).mappings().all()
    items = [
        FlowHistoryEntry(id=r["id"], at=_at(r["at"]), event=r["event"], token_id=r["token_id"], node=r["node_id"],
                         activation=r["activation"], from_state=r["from_state"], to_state=r["to_state"],
                         actor=r["actor"], data=r["data"])
        for r in rows[:limit]
    ]  # fmt: skip
    return FlowHistoryPage(items=items, next_cursor=_encode(items[-1].id) if len(rows) > limit else None)
