"""Flow operations for the command line (:mod:`orbit_server.cli.flows`) and the web console
(:mod:`orbit_server.console.flow_pages`): the functions the API runs (:mod:`orbit_server.flows`),
with the same transactions and retries as :mod:`orbit_server.api.flows`, so a change made here is
exactly one made through the API (README "Flows: client and CLI").

The command line acts as ``store.Principal(key_id=0, role="admin")`` of the namespace it names
(its audit actor is ``orbit-server cli``, or ``<--actor> (orbit-server cli)`` for control); an
id-only command finds the namespace from the instance. No transaction stays open across a
command's output.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_client import (
    FlowControl,
    FlowGraph,
    FlowInstance,
    FlowPublish,
    FlowSignal,
    FlowSignalRecord,
    FlowStart,
    FlowVersion,
)
from orbit_server import _ids, errors
from orbit_server.db import flow_hooks
from orbit_server.db.schema import flow_history, flow_instances, namespaces, queues
from orbit_server.db.transact import transact
from orbit_server.flows import control, engine
from orbit_server.flows import store as flow_store
from orbit_server.settings import ServerSettings
from orbit_server.tasks import store

__all__ = [
    "cli_principal",
    "control_instance",
    "engine_settings",
    "instance_principal",
    "missing_queues",
    "publish",
    "signal",
    "start",
    "visited_nodes",
]

_CONTROLS: dict[str, Callable[..., None]] = {
    "pause": control.pause,
    "resume": control.resume,
    "cancel": control.cancel,
}


def engine_settings(settings: ServerSettings) -> engine.EngineSettings:
    """What step tasks inherit (max attempts, key window), as the server's API uses them."""
    return engine.EngineSettings(
        default_max_attempts=settings.default_max_attempts,
        key_ttl=timedelta(seconds=settings.submission_key_ttl_seconds),
        max_value_bytes=settings.max_body_bytes,
    )


def cli_principal(conn: Connection, namespace: str) -> store.Principal:
    """The command line's principal in ``namespace``. Raises NamespaceNotFound."""
    return store.Principal(
        key_id=0, namespace_id=store.get_namespace_id(conn, namespace), namespace=namespace, role="admin"
    )


def instance_principal(conn: Connection, instance_id: str) -> store.Principal:
    """The command line's principal in the namespace of ``instance_id``. Raises FlowInstanceNotFound."""
    row = None
    if _ids.can_exist(instance_id):
        row = conn.execute(
            sa.select(flow_instances.c.namespace_id, namespaces.c.name)
            .join(namespaces, namespaces.c.id == flow_instances.c.namespace_id)
            .where(flow_instances.c.id == instance_id)
        ).first()
    if row is None:
        raise errors.FlowInstanceNotFound(f"no flow instance {instance_id!r}")
    return store.Principal(key_id=0, namespace_id=int(row[0]), namespace=str(row[1]), role="admin")


def visited_nodes(conn: Connection, instance_id: str) -> set[str]:
    """The nodes the instance's history names (every node a token was on), for the console's picture.

    One ``SELECT DISTINCT`` over the instance's history rows; check the instance's namespace first.
    """
    query = (
        sa.select(flow_history.c.node_id)
        .distinct()
        .where(flow_history.c.instance_id == instance_id, flow_history.c.node_id.is_not(None))
    )
    return {str(node) for node in conn.execute(query).scalars()}


def _instance(db: Engine, principal: store.Principal, instance_id: str) -> FlowInstance:
    with db.connect() as conn:
        return flow_store.get_instance(conn, principal, instance_id)


def missing_queues(conn: Connection, principal: store.Principal, graph: FlowGraph) -> dict[str, list[str]]:
    """The queues the graph's task and poll nodes name that the namespace lacks: ``{queue: [node, ...]}``.

    A publish does not need them (queues may be created later), but an instance that reaches such a
    node fails with ``queue_not_found`` (README "Flows: running them"); the command line warns.
    One ``SELECT`` of the namespace's queue names among those the graph uses.
    """
    used: dict[str, list[str]] = {}
    for node_id, node in graph.nodes.items():
        queue = getattr(node, "queue", None)
        if isinstance(queue, str):
            used.setdefault(queue, []).append(node_id)
    if not used:
        return {}
    present = set(
        conn.execute(
            sa.select(queues.c.name).where(
                queues.c.namespace_id == principal.namespace_id, queues.c.name.in_(sorted(used))
            )
        ).scalars()
    )
    return {queue: nodes for queue, nodes in sorted(used.items()) if queue not in present}


def publish(db: Engine, principal: store.Principal, name: str, body: FlowPublish) -> tuple[FlowVersion, bool]:
    """Publish a version (or find the identical graph's): ``(version, created)``, as ``POST .../versions``."""
    try:
        return transact(db, flow_store.publish, principal, name, body)
    except sa.exc.IntegrityError:  # a concurrent first publish of this flow (or of this graph) won
        return transact(db, flow_store.publish, principal, name, body)


def start(
    db: Engine, principal: store.Principal, name: str, body: FlowStart, key: str, settings: engine.EngineSettings,
    *, on_created: Callable[[], None] | None = None,
) -> tuple[FlowInstance, bool]:  # fmt: skip
    """Start an instance once per key: ``(instance, replayed)``, as ``POST .../instances``.

    Raises FlowNotFound, FlowVersionNotFound, IdempotencyConflict, RequestInProgress (a concurrent
    start with this key has not committed yet).
    """
    try:
        instance_id, replayed, outcome = transact(db, flow_store.start, principal, name, body, key, settings)
    except sa.exc.IntegrityError:  # a concurrent start with this key committed first
        with db.connect() as conn:
            found = flow_store.find_start(conn, principal, key, flow_store.start_digest(name, body))
        if found is None:
            raise errors.RequestInProgress(
                "another start with this idempotency key is being processed; retry shortly"
            ) from None
        instance_id, replayed, outcome = found, True, engine.Outcome("none")
    if outcome.created_tasks and on_created is not None:
        on_created()
    return _instance(db, principal, instance_id), replayed


def signal(
    db: Engine, principal: store.Principal, instance_id: str, body: FlowSignal, key: str,
    settings: engine.EngineSettings, *, on_created: Callable[[], None] | None = None,
) -> tuple[FlowSignalRecord, bool]:  # fmt: skip
    """Record a signal once per key: ``(record, replayed)``, as ``POST .../signals``."""
    try:
        record, replayed, outcome = transact(db, control.signal, principal, instance_id, body, key, settings)
    except sa.exc.IntegrityError:  # a concurrent signal with this identity committed first
        record, replayed, outcome = transact(db, control.signal, principal, instance_id, body, key, settings)
    if outcome.created_tasks and on_created is not None:
        on_created()
    return record, replayed


def control_instance(
    db: Engine, principal: store.Principal, instance_id: str, action: str, body: FlowControl,
    settings: engine.EngineSettings, *, on_created: Callable[[], None] | None = None,
) -> FlowInstance:  # fmt: skip
    """``pause``, ``resume`` or ``cancel`` an instance (audited), as ``POST .../{action}``; the instance after.

    A resume also hands buffered signals to the waits that can take them now, as the API does (the
    flow loop's periodic scan would too). Raises FlowInstanceNotFound, InvalidTransition.
    """
    work = _CONTROLS[action]
    transact(db, work, principal, instance_id, body, settings)
    if action == "resume":
        with db.connect() as conn:
            waits = control.waiting_signal_tokens(conn, instance_id)
        for token_id in waits:
            outcome = transact(db, engine.match_signal, token_id, settings)
            if outcome.created_tasks and on_created is not None:
                on_created()
        flow_hooks.notify()
    return _instance(db, principal, instance_id)
