"""Flow graph nodes: the node models (task, timer, signal, parallel, join, poll, choice, end), path and
template syntax, and the flow limits. Each node checks itself; the graph as a whole is checked by
:class:`~orbit_client.FlowGraph` (:mod:`._flow_graph`). Shared by client and server.

Path syntax (no code is evaluated, README "Flows: graph format"): ``$`` then 1 to
:data:`FLOW_PATH_MAX_SEGMENTS` segments, each ``.name`` (``[A-Za-z_][A-Za-z0-9_-]*``) or ``[n]`` (a list
index, ``n`` ≥ 0). Template paths start at ``input``, ``steps``, ``signals`` or ``instance``; a poll's
``done_path`` starts at ``result``. The server resolves them in ``orbit_server.flows.paths``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal, NotRequired, Self, cast

from pydantic import (
    AfterValidator,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
    model_validator,
)
from typing_extensions import TypedDict

from ._models import NAME_PATTERN, JsonData, _Wire

__all__ = [
    "FLOW_MAX_NODES",
    "FLOW_MAX_SECONDS",
    "FLOW_NODE_ID_PATTERN",
    "FLOW_PATH_MAX_SEGMENTS",
    "FLOW_SIGNAL_NAME_PATTERN",
    "ChoiceNode",
    "ChoiceRule",
    "EndNode",
    "FlowNode",
    "JoinNode",
    "NodeId",
    "ParallelNode",
    "PollNode",
    "Seconds",
    "SignalNode",
    "TaskNode",
    "Template",
    "TemplatePath",
    "TimerNode",
    "parse_flow_path",
]


#: Node ids: a lower-case letter, then up to 63 lower-case letters, digits or ``_``.
FLOW_NODE_ID_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
#: Signal names: a lower-case letter, then up to 63 lower-case letters, digits, ``_``, ``.`` or ``-``.
FLOW_SIGNAL_NAME_PATTERN = r"^[a-z][a-z0-9_.-]{0,63}$"
#: Most segments of a path after ``$`` (``$.input.a[0]`` has three).
FLOW_PATH_MAX_SEGMENTS = 32
#: Most nodes in one graph.
FLOW_MAX_NODES = 1000
#: Longest duration accepted in a graph (timer ``seconds``, timeouts, intervals, deadlines): 366 days.
FLOW_MAX_SECONDS = 366 * 86400

_HANDLER = r"^[\x21-\x7e]+$"
_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(0|[1-9][0-9]{0,8})\]")
_TEMPLATE_ROOTS = ("input", "steps", "signals", "instance")
_STEP_FIELDS = ("status", "result", "error")
_INSTANCE_FIELDS = ("id", "flow", "version")
_LITERAL = "$literal"

NodeId = Annotated[str, Field(pattern=FLOW_NODE_ID_PATTERN)]
#: A duration in seconds: an integer or a finite float, > 0 and at most :data:`FLOW_MAX_SECONDS`.
Seconds = (
    Annotated[StrictInt, Field(gt=0, le=FLOW_MAX_SECONDS)]
    | Annotated[StrictFloat, Field(gt=0, le=FLOW_MAX_SECONDS, allow_inf_nan=False)]
)


# --------------------------------------------------------------------------------------------------
# Paths and templates (syntax only; resolution is orbit_server.flows.paths)


def parse_flow_path(path: str) -> tuple[str | int, ...]:
    """Split a path into its segments: ``"$.input.items[0]"`` → ``("input", "items", 0)``.

    Args:
        path: ``$`` followed by 1 to :data:`FLOW_PATH_MAX_SEGMENTS` segments, each ``.name`` (a letter
            or ``_``, then letters, digits, ``_`` or ``-``) or ``[n]`` (a list index, no leading zeros).

    Returns:
        The segments: ``str`` for names, ``int`` for indexes.

    Raises:
        ValueError: the path is malformed; the message quotes it and says why.
    """
    if not isinstance(path, str) or not path.startswith("$"):
        raise ValueError(f"path {path!r} must start with '$' (e.g. $.input.order_id)")
    segments: list[str | int] = []
    position = 1
    while position < len(path):
        match = _SEGMENT.match(path, position)
        if match is None:
            raise ValueError(
                f"path {path!r} is malformed at character {position + 1}: segments are .name "
                "([A-Za-z_][A-Za-z0-9_-]*) or [n]"
            )
        name, index = match.groups()
        segments.append(name if name is not None else int(index))
        position = match.end()
    if not segments:
        raise ValueError(f"path {path!r} has no segment after '$'")
    if len(segments) > FLOW_PATH_MAX_SEGMENTS:
        raise ValueError(f"path {path!r} has more than {FLOW_PATH_MAX_SEGMENTS} segments (the limit)")
    if not isinstance(segments[0], str):
        raise ValueError(f"path {path!r} must start with a name, not an index")
    return tuple(segments)


def _check_template_path(path: str, step_nodes: frozenset[str] | None) -> None:
    """Check a template path's syntax and root; with ``step_nodes``, that ``$.steps.<node>`` names one."""
    segments = parse_flow_path(path)
    root = segments[0]
    if root not in _TEMPLATE_ROOTS:
        raise ValueError(f"path {path!r} must start with $.input, $.steps, $.signals or $.instance")
    if root == "steps" and len(segments) >= 2:
        node = segments[1]
        if not isinstance(node, str):
            raise ValueError(f"path {path!r}: $.steps is followed by a node id, not an index")
        if step_nodes is not None and node not in step_nodes:
            raise ValueError(f"path {path!r} names {node!r}, which is not a task or poll node of the graph")
        if len(segments) >= 3 and segments[2] not in _STEP_FIELDS:
            raise ValueError(f"path {path!r}: a step has only status, result and error")
    if (
        root == "instance"
        and len(segments) >= 2
        and (segments[1] not in _INSTANCE_FIELDS or len(segments) > 2)
    ):
        raise ValueError(f"path {path!r}: $.instance has only id, flow and version")


def _template_paths(template: Any) -> Iterator[str]:
    """The paths a template evaluates (not those under ``{"$literal": ...}``); raise on a bad ``$`` key."""
    stack = [template]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.startswith("$."):
                yield item
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if _LITERAL in item:
                if len(item) != 1:
                    raise ValueError('{"$literal": X} must be an object with no other key')
                continue
            for key, value in item.items():
                if key.startswith("$"):
                    raise ValueError(
                        f"object key {key!r}: keys starting with '$' are reserved "
                        '(wrap the object in {"$literal": ...} to pass it unevaluated)'
                    )
                stack.append(value)


def _check_template(template: Any, step_nodes: frozenset[str] | None) -> None:
    for path in _template_paths(template):
        _check_template_path(path, step_nodes)


def _syntax_only_template(value: Any) -> Any:
    _check_template(value, None)
    return value


def _syntax_only_path(value: str) -> str:
    _check_template_path(value, None)
    return value


def _done_path(value: str) -> str:
    segments = parse_flow_path(value)
    if segments[0] != "result":
        raise ValueError(f"done_path {value!r} must start with $.result (the round's task result)")
    return value


def _concurrency_key(value: str) -> str:
    if value.startswith("$."):
        _check_template_path(value, None)
    return value


#: A template: JSON data whose ``$.`` strings are paths and whose ``{"$literal": X}`` objects are X.
Template = Annotated[JsonData, AfterValidator(_syntax_only_template)]
#: A path evaluated against the instance data (``$.input...``, ``$.steps...``, ...).
TemplatePath = Annotated[str, Field(max_length=1000), AfterValidator(_syntax_only_path)]


# --------------------------------------------------------------------------------------------------
# Nodes


class _Node(_Wire):
    def references(self) -> list[tuple[str, str]]:
        """The node's edges: ``(field, node id)`` pairs in field order (``("rules[0].next", "a")``)."""
        raise NotImplementedError

    def templates(self) -> list[tuple[str, Any]]:
        """The node's templates and template paths: ``(field, value)`` pairs (``("params", {...})``)."""
        return []


class _TaskOptions(_Wire):
    queue: str = Field(pattern=NAME_PATTERN)
    handler: str = Field(min_length=1, max_length=255, pattern=_HANDLER)
    params: Template = Field(default_factory=dict)
    max_attempts: StrictInt | None = Field(default=None, ge=1, le=100)
    retry_safe: StrictBool = False
    timeout_seconds: Seconds | None = None
    concurrency_key: Annotated[str, AfterValidator(_concurrency_key)] | None = Field(
        default=None, min_length=1, max_length=255, pattern=_HANDLER
    )
    # Left out of the JSON when None, so a flow version's graph parses in older clients.
    priority: StrictInt | None = Field(default=None, ge=-100, le=100, exclude_if=lambda value: value is None)

    def templates(self) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = [("params", self.params)]
        if self.concurrency_key is not None and self.concurrency_key.startswith("$."):
            found.append(("concurrency_key", self.concurrency_key))
        return found


class TaskNode(_TaskOptions, _Node):
    """Run one Orbit task; its outcome moves the token (README "Flows: graph format").

    Attributes:
        queue, handler: the task's queue and handler (the rules of ``POST .../tasks``).
        params: a template rendered against the instance data when the token arrives (default ``{}``).
        max_attempts: 1-100; ``None`` means the server's default for tasks.
        retry_safe: as the task option (default ``False``).
        timeout_seconds: the task's deadline is the database's now + this many seconds; ``None``: none.
        concurrency_key: a string, or a path (``$.input.customer``) whose value (a string or an
            integer) becomes the task's ``concurrency_key``; ``None``: none.
        priority: the task's priority, -100..100 (README "Task priority"); ``None``: 0.
        next: where ``SUCCEEDED`` goes.
        on_failure: where ``FAILED``/``CANCELLED`` goes; ``None``: the instance becomes ``FAILED``,
            with an error naming the node and carrying the task's error. ``NEEDS_REVIEW`` waits
            until a review settles the task.
    """

    type: Literal["task"] = "task"
    next: NodeId
    on_failure: NodeId | None = None

    def references(self) -> list[tuple[str, str]]:
        refs = [("next", self.next)]
        if self.on_failure is not None:
            refs.append(("on_failure", self.on_failure))
        return refs


class TimerNode(_Node):
    """Wait, then go to ``next``: exactly one of ``seconds`` (a duration, > 0, at most 366 days) or
    ``until`` (a path to an RFC 3339 time with an offset in the instance data; a missing or invalid
    value fails the instance, a past time fires at once)."""

    type: Literal["timer"] = "timer"
    seconds: Seconds | None = None
    until: TemplatePath | None = None
    next: NodeId

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.seconds is None) == (self.until is None):
            raise ValueError("a timer needs exactly one of seconds and until")
        return self

    def references(self) -> list[tuple[str, str]]:
        return [("next", self.next)]

    def templates(self) -> list[tuple[str, Any]]:
        return [("until", self.until)] if self.until is not None else []


class SignalNode(_Node):
    """Wait for the named signal (buffered: one received earlier and not yet consumed counts), then go
    to ``next``. With ``timeout_seconds`` (and ``on_timeout``, both or neither), go to ``on_timeout``
    when no signal came within that many seconds of the token's arrival."""

    type: Literal["signal"] = "signal"
    signal: str = Field(pattern=FLOW_SIGNAL_NAME_PATTERN)
    timeout_seconds: Seconds | None = None
    next: NodeId
    on_timeout: NodeId | None = None

    @model_validator(mode="after")
    def _both_or_neither(self) -> Self:
        if (self.timeout_seconds is None) != (self.on_timeout is None):
            raise ValueError("give both timeout_seconds and on_timeout, or neither")
        return self

    def references(self) -> list[tuple[str, str]]:
        refs = [("next", self.next)]
        if self.on_timeout is not None:
            refs.append(("on_timeout", self.on_timeout))
        return refs


class ParallelNode(_Node):
    """Fork: one child token per branch (2-100 distinct nodes); the token continues at ``join`` once
    every child has arrived there. Blocks nest properly: a branch reaches this join, and no other
    join nor an end, first."""

    type: Literal["parallel"] = "parallel"
    branches: list[NodeId] = Field(min_length=2, max_length=100)
    join: NodeId

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        if len(set(self.branches)) != len(self.branches):
            raise ValueError("branches must be distinct nodes")
        return self

    def references(self) -> list[tuple[str, str]]:
        return [*(("branches", b) for b in self.branches), ("join", self.join)]


class JoinNode(_Node):
    """Wait until every branch of its parallel (the one whose ``join`` names this node) has arrived,
    then go to ``next``, once."""

    type: Literal["join"] = "join"
    next: NodeId

    def references(self) -> list[tuple[str, str]]:
        return [("next", self.next)]


class PollNode(_TaskOptions, _Node):
    """Run a task per round until one reports done (seed 001 invariant 11).

    A round is done when the value at ``done_path`` in ``{"result": <the round's task result>}`` is
    ``true``. A ``FAILED``/``CANCELLED`` round is a spent round. The next round starts
    ``interval_seconds`` after the previous one finished. The budget: ``max_rounds`` (1-10000) and, if
    given, ``deadline_seconds`` from the token's arrival. Done → ``next``; budget spent →
    ``on_exhausted``, or the instance ``FAILED`` when ``None``. The task options are :class:`TaskNode`'s.
    """

    type: Literal["poll"] = "poll"
    interval_seconds: Seconds
    max_rounds: StrictInt = Field(ge=1, le=10000)
    deadline_seconds: Seconds | None = None
    done_path: Annotated[str, Field(max_length=1000), AfterValidator(_done_path)]
    next: NodeId
    on_exhausted: NodeId | None = None

    def references(self) -> list[tuple[str, str]]:
        refs = [("next", self.next)]
        if self.on_exhausted is not None:
            refs.append(("on_exhausted", self.on_exhausted))
        return refs


class ChoiceRuleDump(TypedDict):
    """A dumped :class:`ChoiceRule` (its serialization schema): exactly one of equals and present."""

    path: str
    equals: NotRequired[JsonValue]
    present: NotRequired[bool]
    next: str


class ChoiceRule(_Wire):
    """One rule of a choice: ``path`` and exactly one of ``equals`` (JSON equality with the value at
    the path: ``1`` equals ``1.0``, ``true`` does not equal ``1``; a missing path does not match; ``null``
    is a value to compare with) or ``present`` (``true``: the path resolves; ``false``: it does not)."""

    path: TemplatePath
    equals: JsonData = None
    present: StrictBool | None = None
    next: NodeId

    @model_validator(mode="after")
    def _one_test(self) -> Self:
        if ("equals" in self.model_fields_set) == (self.present is not None):
            raise ValueError("a choice rule needs exactly one of equals and present")
        return self

    @property
    def tests_presence(self) -> bool:
        """``True`` for a ``present`` rule, ``False`` for an ``equals`` rule."""
        return self.present is not None

    @model_serializer(mode="wrap")
    def _only_its_test(self, handler: SerializerFunctionWrapHandler) -> ChoiceRuleDump:
        # Write exactly the test the rule has, so a dump validates again (``equals: null`` stays).
        data: dict[str, Any] = handler(self)
        if self.present is not None:
            data.pop("equals", None)
        else:
            data.pop("present", None)
            data["equals"] = self.equals
        return cast(ChoiceRuleDump, data)


class ChoiceNode(_Node):
    """Go to the ``next`` of the first matching rule (1-100 rules, in order), else to ``default``."""

    type: Literal["choice"] = "choice"
    rules: list[ChoiceRule] = Field(min_length=1, max_length=100)
    default: NodeId

    def references(self) -> list[tuple[str, str]]:
        return [*((f"rules[{i}].next", r.next) for i, r in enumerate(self.rules)), ("default", self.default)]

    def templates(self) -> list[tuple[str, Any]]:
        return [(f"rules[{i}].path", r.path) for i, r in enumerate(self.rules)]


class EndNode(_Node):
    """Finish the instance with ``status`` (``COMPLETED`` by default, ``FAILED`` or ``CANCELLED``) and
    ``output``, a template rendered against the instance data (default ``null``). Inside no parallel
    block: a branch reaches its join, never an end."""

    type: Literal["end"] = "end"
    status: Literal["COMPLETED", "FAILED", "CANCELLED"] = "COMPLETED"
    output: Template = None

    def references(self) -> list[tuple[str, str]]:
        return []

    def templates(self) -> list[tuple[str, Any]]:
        return [("output", self.output)] if self.output is not None else []


#: A node of a graph, told apart by ``type``.
FlowNode = Annotated[
    TaskNode | TimerNode | SignalNode | ParallelNode | JoinNode | PollNode | ChoiceNode | EndNode,
    Field(discriminator="type"),
]
