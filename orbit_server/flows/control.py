"""Signals, pause, resume and cancel of flow instances (README "Flows: running them").

Each takes an *exclusive* lock on the instance row first (advances take a shared one: see
:mod:`.engine`), changes the instance and writes its history in one transaction. Run them with
:func:`orbit_server.db.transact.transact`.
"""

from __future__ import annotations

import hashlib
import json

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from orbit_client import FlowControl, FlowSignal, FlowSignalRecord
from orbit_server import _ids, errors
from orbit_server.db.engine import to_utc
from orbit_server.db.schema import flow_signals, flow_tokens
from orbit_server.flows import engine
from orbit_server.flows.store import actor_of
from orbit_server.tasks.store import Principal

__all__ = ["cancel", "pause", "resume", "signal", "signal_digest", "waiting_signal_tokens"]


def _locked(conn: Connection, principal: Principal, instance_id: str, settings: engine.EngineSettings,
            actor: str) -> engine.Advance:  # fmt: skip
    adv = (
        engine.begin(conn, instance_id, settings, exclusive=True, actor=actor)
        if _ids.can_exist(instance_id)
        else None
    )
    if adv is None or adv.instance["namespace_id"] != principal.namespace_id:
        raise errors.FlowInstanceNotFound(f"no flow instance {instance_id!r} in this namespace")
    return adv


def _finished(adv: engine.Advance, what: str) -> errors.InvalidTransition:
    return errors.FlowInstanceFinished(
        f"flow instance {adv.instance['id']} is {adv.instance['status']}: it cannot be {what}"
    )


def signal_digest(body: FlowSignal) -> str:
    """SHA-256 (hex) of the canonical JSON of a signal (name and payload)."""
    text = json.dumps(body.canonical_meaning(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _record(row: RowMapping) -> FlowSignalRecord:
    received = to_utc(row["received_at"])
    assert received is not None
    return FlowSignalRecord(
        id=str(row["id"]), instance_id=row["instance_id"], name=row["name"], payload=row["payload"],
        idempotency_key=row["identity"], received_at=received, consumed_by_token=row["consumed_by_token"],
        consumed_activation=row["consumed_activation"], consumed_at=to_utc(row["consumed_at"]),
    )  # fmt: skip


def _signal_row(conn: Connection, instance_id: str, identity: str) -> RowMapping | None:
    return conn.execute(
        sa.select(flow_signals).where(flow_signals.c.instance_id == instance_id, flow_signals.c.identity == identity)
    ).mappings().first()  # fmt: skip


def signal(
    conn: Connection, principal: Principal, instance_id: str, body: FlowSignal, identity: str,
    settings: engine.EngineSettings,
) -> tuple[FlowSignalRecord, bool, engine.Outcome]:  # fmt: skip
    """Record a signal once per ``(instance, identity)`` and give it to the oldest matching wait, if any.

    Signals are buffered: one that finds no wait stays unconsumed until a matching wait starts
    (the oldest unconsumed first), and one that arrives after its wait timed out stays recorded and
    unconsumed. While the instance is paused it is only recorded (consumed on resume).

    Returns:
        ``(record, replayed, outcome)``.

    Raises:
        errors.FlowInstanceNotFound: 404. errors.IdempotencyConflict: the identity was used with
        another name or payload (409). errors.InvalidTransition: the instance is finished (409).
    """
    adv = _locked(conn, principal, instance_id, settings, actor_of(principal))
    digest = signal_digest(body)
    found = _signal_row(conn, instance_id, identity)
    if found is not None:
        if found["digest"] != digest:
            raise errors.IdempotencyConflict(
                "this Idempotency-Key already sent this instance a signal with another name or payload"
            )
        return _record(found), True, engine.Outcome("none")
    if adv.instance["status"] in engine.FINISHED:
        raise _finished(adv, "signalled")
    conn.execute(
        flow_signals.insert().values(
            instance_id=instance_id, identity=identity, name=body.name, payload=body.payload, digest=digest,
            actor=adv.actor, received_at=adv.now,
        )
    )  # fmt: skip
    row = _signal_row(conn, instance_id, identity)
    assert row is not None
    adv.record("signal_received", data={"signal": body.name, "signal_id": row["id"]})
    outcome = "applied"
    if adv.instance["status"] == engine.RUNNING:
        waiting = conn.execute(
            sa.select(flow_tokens)
            .where(flow_tokens.c.instance_id == instance_id, flow_tokens.c.state == engine.WAITING,
                   flow_tokens.c.waiting_for == f"signal:{body.name}")
            .order_by(flow_tokens.c.updated_at, flow_tokens.c.id)
            .limit(1)
            .with_for_update()
        ).mappings().first()  # fmt: skip
        if waiting is not None:
            adv.actor = engine.FLOW_ACTOR
            engine.deliver_signal(adv, dict(waiting))
            row = _signal_row(conn, instance_id, identity)
            assert row is not None
    adv.flush()
    return _record(row), False, engine.Outcome(outcome, adv.created_tasks)


def pause(conn: Connection, principal: Principal, instance_id: str, body: FlowControl,
          settings: engine.EngineSettings) -> None:  # fmt: skip
    """Close the instance's execution gate (invariant 12): status ``PAUSED``, ``paused``, ``control_version``
    + 1, audited, in one transaction. Tasks in flight finish and their results are recorded as pending
    events; no task, timer or poll round starts until :func:`resume`. Pausing a paused instance changes
    nothing. Raises FlowInstanceNotFound, InvalidTransition (finished)."""
    adv = _locked(conn, principal, instance_id, settings, actor_of(principal, body.actor))
    inst = adv.instance
    if inst["status"] in engine.FINISHED:
        raise _finished(adv, "paused")
    if inst["paused"]:
        return
    engine.set_instance(adv, "instance_paused", data={"reason": body.reason}, status=engine.PAUSED, paused=True,
                        control_version=int(inst["control_version"]) + 1)  # fmt: skip
    adv.flush()


def resume(conn: Connection, principal: Principal, instance_id: str, body: FlowControl,
           settings: engine.EngineSettings) -> None:  # fmt: skip
    """Open the gate again: status ``RUNNING``, ``control_version`` + 1, audited; the flow loop then applies
    the pending events, due timers and buffered signals. Resuming a running instance changes nothing.
    Raises FlowInstanceNotFound, InvalidTransition (finished)."""
    adv = _locked(conn, principal, instance_id, settings, actor_of(principal, body.actor))
    inst = adv.instance
    if inst["status"] in engine.FINISHED:
        raise _finished(adv, "resumed")
    if not inst["paused"]:
        return
    engine.set_instance(adv, "instance_resumed", data={"reason": body.reason}, status=engine.RUNNING, paused=False,
                        control_version=int(inst["control_version"]) + 1)  # fmt: skip
    adv.wake()
    adv.flush()


def cancel(conn: Connection, principal: Principal, instance_id: str, body: FlowControl,
           settings: engine.EngineSettings) -> None:  # fmt: skip
    """Cancel the instance: ``CANCELLED``, its live tokens ``CANCELLED``, pending timers ``CANCELLED``, a
    cancel request for every live step task (as the task cancel API makes), ``control_version`` + 1,
    audited, in one transaction. Raises FlowInstanceNotFound, InvalidTransition (finished)."""
    adv = _locked(conn, principal, instance_id, settings, actor_of(principal, body.actor))
    if adv.instance["status"] in engine.FINISHED:
        raise _finished(adv, "cancelled")
    engine.finish(adv, engine.CANCELLED, reason=body.reason or "cancelled through the API", actor=adv.actor,
                  control=True)  # fmt: skip
    adv.flush()


def waiting_signal_tokens(conn: Connection, instance_id: str) -> list[str]:
    """The instance's tokens waiting for a signal (to match buffered signals after a resume)."""
    return list(
        conn.execute(
            sa.select(flow_tokens.c.id).where(
                flow_tokens.c.instance_id == instance_id, flow_tokens.c.state == engine.WAITING,
                flow_tokens.c.waiting_for.like("signal:%"),
            )
        ).scalars()
    )  # fmt: skip
