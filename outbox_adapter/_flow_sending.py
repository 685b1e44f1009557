"""Flow rows (README "Starting flows from the outbox"): how the relay starts a flow instance for an
outbox row, how the answer is classified, and how a row is settled by its key.

A flow row is sent alone, ``POST /v1/namespaces/{ns}/flows/{flow}/instances`` with the row's
``Idempotency-Key`` and ``{"input": <params>, "version": N?}``, outside any transaction. The
answer is classified as a task submission's is (``_outcomes``), with the flow contract's codes:

=============================================  ==================  ===========================================
what came back                                 verdict             the row
=============================================  ==================  ===========================================
201 (new instance) / 200 (replay)              ``DELIVERED``       ``DELIVERED``, the instance id in
                                                                   ``orbit_task_id``
410 ``flow_instance_purged`` with its         ``DELIVERED``       ``DELIVERED`` with that instance id (it ran
``instance_id``                                                    and was purged since: never started again)
409 ``idempotency_conflict`` (the key started  ``RECONCILE``       ``NEEDS_RECONCILE``: a person decides
another flow or input)
404 (unknown namespace, flow or version, or  ``DEAD``            ``DEAD``, with the command that fixes it
an older server without the flows API)
anything else                                  as for a task       (``classify_error``)
=============================================  ==================  ===========================================

A flow start's key is remembered as long as its instance exists, and after a purge as a tombstone
until the instance's ``finished_at`` plus the server's key window (README "Retention and the key
window"), so the relay's key window (``_sending.KeyWindow``) does not apply to flow rows, and
reconcile never answers ``too_old`` for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orbit_client import OrbitAPIError, OrbitClient
from outbox_adapter import _queries as q
from outbox_adapter._outcomes import SendOutcome, Verdict, classify_error

__all__ = ["StartedInstance", "find_flow_start", "get_flow_instance", "start_flow"]

#: Problem codes of a flow start that mean "this key already names another start" (flows contract).
_CONFLICT_CODES = frozenset({"idempotency_conflict", "idempotency_key_reused"})


@dataclass(frozen=True)
class StartedInstance:
    """The part of a ``FlowInstance`` the outbox needs: its id, flow, version and input."""

    id: str
    flow: str
    version: int | None
    input: Any

    @classmethod
    def of(cls, data: Any) -> StartedInstance:
        """From a ``FlowInstance`` (model or JSON)."""
        if not isinstance(data, dict):
            dump = getattr(data, "model_dump", None)
            data = dump(mode="json") if dump is not None else vars(data)
        return cls(
            id=str(data["id"]),
            flow=str(data.get("flow", "")),
            version=data.get("version"),
            input=data.get("input"),
        )


def _dead_flow_hint(claim: q.Claim, code: str | None) -> str:
    """What to do about a 404 for the row's flow (``code`` ``flow_not_found``) or its version."""
    version = (claim.options or {}).get("version")
    delete = (
        f"delete the row: `orbit-outbox purge --dead-older-than 0s --row {claim.id} --reason TEXT` (audited)"
    )
    if version and code != "flow_not_found":
        # Publishing makes the *next* number, not this one: say how to see what exists instead.
        return (
            f"version {version} of flow {claim.flow!r} of namespace {claim.namespace!r} does not exist for the "
            f"relay's API key (`orbit-server flow versions {claim.flow} --namespace {claim.namespace}` lists the "
            f"published ones; each publish of a new graph takes the next number); once it exists, run "
            f"`orbit-outbox retry {claim.id}`; if the row names the wrong version, {delete}"
        )
    return (
        f"flow {claim.flow!r} of namespace {claim.namespace!r} does not exist for the relay's API key; if the name "
        f"is right, publish it (`orbit-server flow publish GRAPH.json --flow {claim.flow} --namespace "
        f"{claim.namespace}`) and run `orbit-outbox retry {claim.id}`; if it is wrong, {delete}"
    )


def start_flow(
    client: OrbitClient, claim: q.Claim, traceparent: str | None, tracestate: str | None
) -> SendOutcome:
    """Start the flow instance of ``claim`` with its key; the classified outcome. Never raises."""
    assert claim.flow is not None
    version = (claim.options or {}).get("version")
    try:
        result = client.start_flow(
            claim.namespace,
            claim.flow,
            claim.params if claim.params is not None else {},
            idempotency_key=claim.idempotency_key,
            version=version,
            traceparent=traceparent,
            tracestate=tracestate,
        )
    except OrbitAPIError as exc:
        purged = (exc.problem.model_extra or {}).get("instance_id") if exc.problem is not None else None
        if exc.status_code == 410 and exc.code == "flow_instance_purged" and isinstance(purged, str):
            return SendOutcome(verdict=Verdict.DELIVERED, task_id=purged, replayed=True, status_code=410)
        if exc.code in _CONFLICT_CODES:
            return SendOutcome(
                verdict=Verdict.RECONCILE,
                status_code=exc.status_code,
                error=f"{exc} (the key already started another flow or input; settle the row with "
                '`orbit-outbox resolve`, README "Outbox")',
            )
        if exc.status_code in (404, 405) and exc.code in (None, "", "not_found", "method_not_allowed"):
            return SendOutcome(  # no such route: nothing was started
                verdict=Verdict.DEAD,
                status_code=exc.status_code,
                error=f"{exc}; the Orbit server has no flows API: upgrade it, then run `orbit-outbox retry {claim.id}`",
            )
        if exc.status_code == 404:
            return SendOutcome(
                verdict=Verdict.DEAD, status_code=404, error=f"{exc}; " + _dead_flow_hint(claim, exc.code)
            )
        return classify_error(exc)
    except Exception as exc:
        return classify_error(exc)
    return SendOutcome(
        verdict=Verdict.DELIVERED,
        task_id=result.instance.id,
        replayed=result.replayed,
        status_code=200 if result.replayed else 201,
    )


def find_flow_start(client: OrbitClient, namespace: str, idempotency_key: str) -> StartedInstance | None:
    """The instance a flow start's key created (``GET .../flow-instances?idempotency_key=K``), or ``None``.

    Raises:
        OrbitError: the lookup failed (the server is unreachable, the key is refused, ...).
    """
    found = client.find_flow_instance(namespace, idempotency_key)
    return StartedInstance.of(found) if found is not None else None


def get_flow_instance(client: OrbitClient, namespace: str, instance_id: str) -> StartedInstance:
    """``GET .../flow-instances/{id}`` (for ``resolve --delivered-as`` of a flow row).

    Raises:
        NotFoundError: no such instance in the namespace.
        OrbitError: as for every call.
    """
    return StartedInstance.of(client.get_flow_instance(namespace, instance_id))


def same_start(found: StartedInstance, row_flow: str | None, row_input: Any) -> bool:
    """Whether the instance a key names is this row's start (same flow and input)."""
    return found.flow == row_flow and found.input == (row_input if row_input is not None else {})
