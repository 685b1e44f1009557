"""Wire models of flows (``/v1/namespaces/{ns}/flows``, ``.../flow-instances``), shared by client and server.

A flow is a published, immutable graph version (:class:`FlowGraph`); an instance runs one version for
life (invariant 10 of seed 001). The graph is validated here, by the model, so the client refuses a bad
graph before sending it and the server answers ``422 validation_error`` with the same message, which
names the node at fault (README "Flows: graph format").

Path syntax (no code is evaluated, README "Flows: graph format"): ``$`` then 1 to
:data:`FLOW_PATH_MAX_SEGMENTS` segments, each ``.name`` (``[A-Za-z_][A-Za-z0-9_-]*``) or ``[n]`` (a list
index, ``n`` ≥ 0). Template paths start at ``input``, ``steps``, ``signals`` or ``instance``; a poll's
``done_path`` starts at ``result``. The server resolves them in ``orbit_server.flows.paths``.

This module holds the wire models of publishing, instances, signals and history; the graph is in
:mod:`._flow_graph`, its nodes and the path syntax in :mod:`._flow_nodes`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictInt,
)

from orbit_client._flow_graph import FlowGraph
from orbit_client._flow_nodes import FLOW_SIGNAL_NAME_PATTERN

from ._models import JsonData, UTCDateTime, _Wire, canonical_json, check_json_data
from ._task_models import TaskStatus

__all__ = [
    "FlowControl",
    "FlowHistoryEntry",
    "FlowHistoryPage",
    "FlowInstance",
    "FlowInstancePage",
    "FlowInstanceStatus",
    "FlowPublish",
    "FlowSignal",
    "FlowSignalRecord",
    "FlowStart",
    "FlowStep",
    "FlowSummary",
    "FlowToken",
    "FlowTokenState",
    "FlowVersion",
]


# --------------------------------------------------------------------------------------------------
# Definitions and versions


class FlowPublish(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/flows/{name}/versions``: the graph and an optional
    description (1-2000 characters, audited with the publication)."""

    graph: FlowGraph
    description: str | None = Field(default=None, min_length=1, max_length=2000)


class FlowVersion(_Wire):
    """A published version of a flow, immutable.

    Attributes:
        namespace, flow: the flow it belongs to.
        version: 1, 2, ... in order of publication.
        digest: :func:`canonical_graph_digest` of ``graph``.
        graph: the graph (the server stores it in canonical form, :func:`canonical_graph`; on the
            wire every field is written out, defaults included).
        description: what the publisher said about it; ``None``: nothing.
        published_at: when (UTC, database clock).
        published_by: the API key's name (and actor) that published it; ``None`` when unknown.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    namespace: str
    flow: str
    version: int
    digest: str
    graph: FlowGraph
    description: str | None = None
    published_at: UTCDateTime
    published_by: str | None = None


class FlowSummary(_Wire):
    """A flow of ``GET /v1/namespaces/{ns}/flows``: its newest version number and when it was first
    and last published (UTC)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    namespace: str
    name: str
    latest_version: int
    created_at: UTCDateTime
    updated_at: UTCDateTime


# --------------------------------------------------------------------------------------------------
# Instances


class FlowInstanceStatus(enum.StrEnum):
    """An instance's state. ``PAUSED`` comes and goes with pause/resume; the last three are final."""

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        """``True`` for ``COMPLETED``, ``FAILED`` and ``CANCELLED``."""
        return self in (FlowInstanceStatus.COMPLETED, FlowInstanceStatus.FAILED, FlowInstanceStatus.CANCELLED)


class FlowTokenState(enum.StrEnum):
    """A token's state (seed 002). ``ACTIVE``: entering or leaving its node; ``WAITING``: on a task,
    timer, signal, poll round or review (``waiting_for`` says which); ``FORKED``: a parallel's token
    while its children run; ``ARRIVED``: a child at its join, waiting for its siblings; ``DONE`` and
    ``CANCELLED`` are final."""

    ACTIVE = "ACTIVE"
    WAITING = "WAITING"
    FORKED = "FORKED"
    ARRIVED = "ARRIVED"
    DONE = "DONE"
    CANCELLED = "CANCELLED"

    @property
    def is_final(self) -> bool:
        """``True`` for ``DONE`` and ``CANCELLED``."""
        return self in (FlowTokenState.DONE, FlowTokenState.CANCELLED)


def _json_object(value: dict[str, Any]) -> dict[str, Any]:
    check_json_data(value)
    return value


class FlowStart(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/flows/{name}/instances`` (with ``Idempotency-Key``).

    Attributes:
        input: the instance's input, a JSON object (``$.input`` in paths); default ``{}``.
        version: the version to run; ``None`` means the newest at the time of the start.
    """

    input: Annotated[dict[str, JsonValue], AfterValidator(_json_object)] = Field(default_factory=dict)
    version: StrictInt | None = Field(default=None, ge=1)

    def canonical_meaning(self) -> dict[str, Any]:
        """What the start means, as JSON data, for the request digest (integral numbers as integers;
        ``version: null`` stays: "the newest" is a different request from "version 3")."""
        return {"input": canonical_json(self.input), "version": self.version}


class FlowToken(_Wire):
    """A position in an instance (seed 002).

    Attributes:
        id: the token's id.
        node: the node it is on.
        state: :class:`FlowTokenState`.
        activation: how many times this token has entered a node (1 on its first node); a task
            result advances only the activation it belongs to.
        parent_id: the forking token, for a branch's token; ``None`` for the root token.
        task_id: the task of its current node, if any.
        waiting_for: what it waits for, for a person: ``"task"``, ``"timer"``, ``"signal:cancel"``,
            ``"poll round 3 of 10"``, ``"join"``, ``"review"``; ``None`` when not waiting.
        fire_at: when its timer, signal timeout or next poll round is due (UTC); ``None``: none.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    node: str
    state: FlowTokenState
    activation: int
    parent_id: str | None = None
    task_id: str | None = None
    waiting_for: str | None = None
    fire_at: UTCDateTime | None = None


class FlowStep(_Wire):
    """One task a node ran for one activation of a token (a poll node: one per ``round``, from 1).

    ``status`` is the task's status; ``result``/``error`` the task's once it finished.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    node: str
    activation: int
    token_id: str
    task_id: str
    status: TaskStatus
    result: JsonValue = None
    error: JsonValue = None
    round: int | None = None
    created_at: UTCDateTime
    finished_at: UTCDateTime | None = None


class FlowInstance(_Wire):
    """An instance as the server reports it (``GET .../flow-instances/{id}``).

    Attributes:
        id, namespace, flow, version: which instance, of which flow version (fixed for life).
        status: :class:`FlowInstanceStatus`; ``paused`` is ``True`` while paused.
        input: the start's input; ``output``: the end node's rendered output once ``COMPLETED``
            (or other end); ``error``: why it ``FAILED`` (names the node), else ``None``.
        idempotency_key: the start's ``Idempotency-Key``.
        control_version: bumped by every pause, resume and cancel.
        state_version: bumped by every change of the instance or its tokens.
        created_at, updated_at, finished_at: UTC, database clock (``finished_at`` ``None`` while live).
        tokens: its tokens (live and finished); steps: its steps, oldest first.
        pending_events: task outcomes recorded but not yet applied to the flow ("the task has a
            result, the flow has not advanced yet", e.g. while paused).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    namespace: str
    flow: str
    version: int
    status: FlowInstanceStatus
    paused: bool = False
    input: JsonValue = None
    output: JsonValue = None
    error: JsonValue = None
    idempotency_key: str | None = None
    control_version: int
    state_version: int
    created_at: UTCDateTime
    updated_at: UTCDateTime
    finished_at: UTCDateTime | None = None
    tokens: list[FlowToken] = Field(default_factory=list)
    steps: list[FlowStep] = Field(default_factory=list)
    pending_events: int = 0


class FlowInstancePage(_Wire):
    """A page of ``GET .../flow-instances``, newest first. Pass ``next_cursor`` back as ``cursor``;
    ``None`` means this is the last page."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    items: list[FlowInstance]
    next_cursor: str | None = None


class FlowControl(_Wire):
    """Body of ``POST .../flow-instances/{id}/cancel|pause|resume``: why (1-2000 characters) and who
    (1-255), both audited; ``None``: not given."""

    reason: str | None = Field(default=None, min_length=1, max_length=2000)
    actor: str | None = Field(default=None, min_length=1, max_length=255)


class FlowSignal(_Wire):
    """Body of ``POST .../flow-instances/{id}/signals``; the ``Idempotency-Key`` header is the
    signal's identity (a repeat is a replay). ``payload``: any JSON (``$.signals.<name>``)."""

    name: str = Field(pattern=FLOW_SIGNAL_NAME_PATTERN)
    payload: JsonData = None

    def canonical_meaning(self) -> dict[str, Any]:
        """What the signal means, as JSON data, for the request digest."""
        return {"name": self.name, "payload": canonical_json(self.payload)}


class FlowSignalRecord(_Wire):
    """A received signal. ``consumed_by_token``/``consumed_activation``/``consumed_at``: the wait that
    consumed it; ``None`` while unconsumed (buffered, or arrived after its wait timed out)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    instance_id: str
    name: str
    payload: JsonValue = None
    idempotency_key: str
    received_at: UTCDateTime
    consumed_by_token: str | None = None
    consumed_activation: int | None = None
    consumed_at: UTCDateTime | None = None


class FlowHistoryEntry(_Wire):
    """One change of an instance or one of its tokens (``GET .../history``, oldest first).

    ``event`` names the change (e.g. ``instance_started``, ``entered``, ``task_succeeded``,
    ``signal_received``, ``timer_fired``, ``forked``, ``joined``, ``instance_paused``); ``node`` and
    ``activation`` are where the token is *after* the change (a ``task_succeeded`` entry names the
    node the token moved on to; ``data.task_id`` the finished step's task); ``from_state``/``to_state``
    are token or instance states; ``actor`` who asked (control changes); ``data`` details as JSON.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: int
    at: UTCDateTime
    event: str
    token_id: str | None = None
    node: str | None = None
    activation: int | None = None
    from_state: str | None = None
    to_state: str | None = None
    actor: str | None = None
    data: JsonValue = None


class FlowHistoryPage(_Wire):
    """A page of an instance's history, oldest first; ``next_cursor`` as in :class:`FlowInstancePage`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    items: list[FlowHistoryEntry]
    next_cursor: str | None = None
