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
409 ``idempotency_conflict`` (the key started  ``RECONCILE``       ``NEEDS_RECONCILE``: a person decides
another flow or input)
404 (unknown namespace, flow or version)       ``DEAD``            ``DEAD``, with the command that fixes it
anything else                                  as for a task       (``classify_error``)
=============================================  ==================  ===========================================

A flow start's key is remembered as long as its instance exists, so the relay's key window
(``_sending.KeyWindow``) does not apply to flow rows, and reconcile never answers ``too_old`` for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orbit_client import OrbitAPIError, OrbitClient, OrbitUsageError
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
        """From a ``FlowInstance`` model or its JSON (either is accepted: ``orbit_client`` versions differ)."""
        if not isinstance(data, dict):
            dump = getattr(data, "model_dump", None)
            data = dump(mode="json") if dump is not None else vars(data)
        return cls(
            id=str(data["id"]),
            flow=str(data.get("flow", "")),
            version=data.get("version"),
            input=data.get("input"),
        )


def _body(claim: q.Claim) -> dict[str, Any]:
    body: dict[str, Any] = {"input": claim.params if claim.params is not None else {}}
    version = (claim.options or {}).get("version")
    if version is not None:
        body["version"] = version
    return body


def _dead_flow_hint(claim: q.Claim) -> str:
    version = (claim.options or {}).get("version")
    what = f"version {version} of flow {claim.flow!r}" if version else f"flow {claim.flow!r}"
    return (
        f"{what} of namespace {claim.namespace!r} does not exist for the relay's API key; if the name is right, "
        f"publish it (`orbit-server flow publish {claim.namespace} {claim.flow} GRAPH.json`) and run "
        f"`orbit-outbox retry {claim.id}`; if it is wrong, delete the row: `orbit-outbox purge --dead-older-than 0s "
        f"--row {claim.id} --reason TEXT` (audited)"
    )


def start_flow(
    client: OrbitClient, claim: q.Claim, traceparent: str | None, tracestate: str | None
) -> SendOutcome:
    """Start the flow instance of ``claim`` with its key; the classified outcome. Never raises."""
    assert claim.flow is not None
    headers = {"Idempotency-Key": claim.idempotency_key}
    if traceparent is not None:
        headers["traceparent"] = traceparent
        if tracestate:
            headers["tracestate"] = tracestate
    try:
        path = client._path("/v1/namespaces/{}/flows/{}/instances", claim.namespace, claim.flow)
        response = client._request("POST", path, json=_body(claim), headers=headers)
        started = StartedInstance.of(response.json())
    except OrbitAPIError as exc:
        if exc.code in _CONFLICT_CODES:
            return SendOutcome(
                verdict=Verdict.RECONCILE,
                status_code=exc.status_code,
                error=f"{exc} (the key already started another flow or input; settle the row with "
                '`orbit-outbox resolve`, README "Outbox")',
            )
        if exc.status_code == 404:
            return SendOutcome(
                verdict=Verdict.DEAD, status_code=404, error=f"{exc}; " + _dead_flow_hint(claim)
            )
        return classify_error(exc)
    except (KeyError, TypeError, ValueError) as exc:  # a 2xx without an instance: it may exist
        return SendOutcome(
            verdict=Verdict.UNKNOWN,
            error=f"unexpected answer to a flow start ({exc!r}); the instance may exist",
        )
    except Exception as exc:
        return classify_error(exc)
    replayed = response.status_code == 200
    return SendOutcome(
        verdict=Verdict.DELIVERED, task_id=started.id, replayed=replayed, status_code=response.status_code
    )


def find_flow_start(client: OrbitClient, namespace: str, idempotency_key: str) -> StartedInstance | None:
    """The instance a flow start's key created (``GET .../flow-instances?idempotency_key=K``), or ``None``.

    Raises:
        OrbitError: the lookup failed (the server is unreachable, the key is refused, ...).
    """
    path = client._path("/v1/namespaces/{}/flow-instances", namespace)
    response = client._request("GET", path, params={"idempotency_key": idempotency_key, "limit": "1"})
    items = response.json().get("items") or []
    return StartedInstance.of(items[0]) if items else None


def get_flow_instance(client: OrbitClient, namespace: str, instance_id: str) -> StartedInstance:
    """``GET .../flow-instances/{id}`` (for ``resolve --delivered-as`` of a flow row).

    Raises:
        NotFoundError: no such instance in the namespace.
        OrbitError: as for every call.
    """
    if not isinstance(instance_id, str) or not instance_id:
        raise OrbitUsageError("a flow instance id is a non-empty string")
    path = client._path("/v1/namespaces/{}/flow-instances/{}", namespace, instance_id)
    return StartedInstance.of(client._request("GET", path).json())


def same_start(found: StartedInstance, row_flow: str | None, row_input: Any) -> bool:
    """Whether the instance a key names is this row's start (same flow and input)."""
    return found.flow == row_flow and found.input == (row_input if row_input is not None else {})
