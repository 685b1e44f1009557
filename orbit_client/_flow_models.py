"""Wire models of flows (``/v1/namespaces/{ns}/flows``, ``.../flow-instances``), shared by client and server.

A flow is a published, immutable graph version (:class:`FlowGraph`); an instance runs one version for
life (invariant 10 of seed 001). The graph is validated here, by the model, so the client refuses a bad
graph before sending it and the server answers ``422 validation_error`` with the same message, which
names the node at fault (README "Flows: graph format").

Path syntax (no code is evaluated, README "Flows: graph format"): ``$`` then 1 to
:data:`FLOW_PATH_MAX_SEGMENTS` segments, each ``.name`` (``[A-Za-z_][A-Za-z0-9_-]*``) or ``[n]`` (a list
index, ``n`` ≥ 0). Template paths start at ``input``, ``steps``, ``signals`` or ``instance``; a poll's
``done_path`` starts at ``result``. The server resolves them in ``orbit_server.flows.paths``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal, NotRequired, Self, cast

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
    model_validator,
)
from typing_extensions import TypedDict

from ._models import NAME_PATTERN, JsonData, UTCDateTime, _Wire, canonical_json, check_json_data
from ._task_models import TaskStatus

__all__ = [
    "FLOW_MAX_NODES",
    "FLOW_NODE_ID_PATTERN",
    "FLOW_PATH_MAX_SEGMENTS",
    "FLOW_SIGNAL_NAME_PATTERN",
    "ChoiceNode",
    "ChoiceRule",
    "EndNode",
    "FlowControl",
    "FlowGraph",
    "FlowHistoryEntry",
    "FlowHistoryPage",
    "FlowInstance",
    "FlowInstancePage",
    "FlowInstanceStatus",
    "FlowNode",
    "FlowPublish",
    "FlowSignal",
    "FlowSignalRecord",
    "FlowStart",
    "FlowStep",
    "FlowSummary",
    "FlowToken",
    "FlowTokenState",
    "FlowVersion",
    "JoinNode",
    "ParallelNode",
    "PollNode",
    "SignalNode",
    "TaskNode",
    "TimerNode",
    "canonical_graph",
    "canonical_graph_digest",
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


# --------------------------------------------------------------------------------------------------
# The graph


class FlowGraph(_Wire):
    """A flow graph: ``start`` and ``nodes`` (id → node, 1 to :data:`FLOW_MAX_NODES`).

    Validation (a ``ValueError`` naming the node; ``422 validation_error`` from the server): every
    reference names a node; every node is reachable from ``start``; from every node an ``end`` is
    reachable (inside a parallel block: the block's join); each ``parallel.join`` names a ``join``
    node, and each join belongs to exactly one parallel; blocks nest properly (no edge leaves or
    enters a block except through its parallel and its join; a branch meets no end and no other
    join first); ``$.steps.<node>`` paths name task or poll nodes.

    After validation the graph answers the engine's questions: :meth:`successors`,
    :meth:`join_of`, :meth:`parallel_of`, :meth:`enclosing_parallel`.
    :meth:`canonical` is the form the server stores and digests.
    """

    start: NodeId
    nodes: dict[NodeId, FlowNode] = Field(min_length=1, max_length=FLOW_MAX_NODES)

    _blocks: dict[str, tuple[str, ...]] = PrivateAttr(default_factory=dict)
    _parallel_of: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_graph(self) -> Self:
        nodes = self.nodes
        if self.start not in nodes:
            raise ValueError(f"start {self.start!r} is not a node of the graph")
        if isinstance(nodes[self.start], JoinNode):
            raise ValueError(f"start {self.start!r} is a join node: a flow cannot start at a join")
        step_nodes = frozenset(n for n, node in nodes.items() if isinstance(node, TaskNode | PollNode))
        parallel_of: dict[str, str] = {}
        for node_id, node in nodes.items():
            for field, target in node.references():
                if target not in nodes:
                    raise ValueError(f"node {node_id!r}: {field} {target!r} is not a node of the graph")
            for field, template in node.templates():
                try:
                    _check_template(template, step_nodes)
                except ValueError as exc:
                    raise ValueError(f"node {node_id!r}: {field}: {exc}") from None
            if isinstance(node, ParallelNode):
                if not isinstance(nodes[node.join], JoinNode):
                    kind = nodes[node.join].type
                    article = "an" if kind[0] in "aeiou" else "a"
                    raise ValueError(
                        f"node {node_id!r}: join {node.join!r} is {article} {kind} node, not a join"
                    )
                if node.join in parallel_of:
                    raise ValueError(
                        f"join {node.join!r} is the join of both {parallel_of[node.join]!r} and {node_id!r}"
                    )
                parallel_of[node.join] = node_id
        for node_id, node in nodes.items():
            if isinstance(node, JoinNode) and node_id not in parallel_of:
                raise ValueError(f"join {node_id!r} is the join of no parallel node")
        blocks = self._assign_blocks(parallel_of)
        for node_id in nodes:
            if node_id not in blocks:
                raise ValueError(f"node {node_id!r} is not reachable from start {self.start!r}")
        self._check_progress(blocks, parallel_of)
        self._blocks = blocks
        self._parallel_of = parallel_of
        return self

    def _assign_blocks(self, parallel_of: dict[str, str]) -> dict[str, tuple[str, ...]]:
        """Each reachable node's enclosing parallel nodes, outermost first; raise where blocks cross."""
        nodes = self.nodes
        blocks: dict[str, tuple[str, ...]] = {}
        reached_from: dict[str, str] = {}
        # (node, its enclosing parallels, the node and field that led there)
        pending: list[tuple[str, tuple[str, ...], str | None]] = [(self.start, (), None)]
        while pending:
            node_id, stack, came_from = pending.pop()
            node = nodes[node_id]
            if isinstance(node, JoinNode) and came_from is not None:
                # An edge into a join: an arrival, allowed only from inside that join's own block.
                owner = parallel_of[node_id]
                if not stack or stack[-1] != owner:
                    where = f"inside parallel {stack[-1]!r}" if stack else "outside any parallel"
                    raise ValueError(
                        f"{came_from} leads to join {node_id!r} of parallel {owner!r} from {where}"
                    )
                continue
            if isinstance(node, EndNode) and stack:
                raise ValueError(
                    f"{came_from} leads to end {node_id!r} inside parallel {stack[-1]!r}: a branch must "
                    f"reach its join {self.join_of(stack[-1])!r} first"
                )
            known = blocks.get(node_id)
            if known is not None:
                if known != stack:
                    raise ValueError(
                        f"{came_from or 'start'} leads to node {node_id!r} {_where(stack)}, but it is also "
                        f"reached {_where(known)} (from {reached_from[node_id]}): an edge may not leave or "
                        "enter a parallel block except through its parallel and its join"
                    )
                continue
            blocks[node_id] = stack
            reached_from[node_id] = came_from or ("start" if node_id == self.start else "its parallel")
            if isinstance(node, EndNode):
                continue
            if isinstance(node, ParallelNode):
                for branch in node.branches:
                    pending.append((branch, (*stack, node_id), f"node {node_id!r} (branches)"))
                # The forking token itself continues at the join, in the enclosing block.
                pending.append((node.join, stack, None))
                continue
            for field, target in node.references():
                pending.append((target, stack, f"node {node_id!r} ({field})"))
        return blocks

    def _check_progress(self, blocks: dict[str, tuple[str, ...]], parallel_of: dict[str, str]) -> None:
        """From every node, an end (outside blocks) or the block's join must be reachable.

        A walk back from the goals (ends; nodes with an edge to their own block's join) over the edges
        that stay at one block level (a parallel counts as an edge to its join): linear in the graph.
        """
        nodes = self.nodes
        before: dict[str, list[str]] = {node_id: [] for node_id in nodes}
        good: set[str] = set()
        for node_id, node in nodes.items():
            stack = blocks[node_id]
            if isinstance(node, EndNode):
                good.add(node_id)
            elif isinstance(node, ParallelNode):
                before[node.join].append(node_id)
            else:
                own_join = self.join_of(stack[-1]) if stack else None
                for _, target in node.references():
                    if target == own_join:
                        good.add(node_id)  # it can arrive at its block's join
                    else:
                        before[target].append(node_id)
        frontier = list(good)
        while frontier:
            for node_id in before[frontier.pop()]:
                if node_id not in good:
                    good.add(node_id)
                    frontier.append(node_id)
        for node_id in nodes:
            if node_id not in good:
                stack = blocks[node_id]
                if stack:
                    owner = stack[-1]
                    raise ValueError(
                        f"node {node_id!r} (in a branch of parallel {owner!r}) cannot reach its join "
                        f"{self.join_of(owner)!r}"
                    )
                raise ValueError(f"node {node_id!r} cannot reach an end node")

    # ------------------------------------------------------------------ questions of the engine

    def successors(self, node_id: str) -> list[str]:
        """The nodes a token on ``node_id`` can move to, in field order, without repeats.

        For a parallel: its branches (its children start there; the token itself waits and continues
        at :meth:`join_of`). For an end: ``[]``. Raises ``KeyError`` for an unknown node.
        """
        node = self.nodes[node_id]
        if isinstance(node, ParallelNode):
            return list(node.branches)
        return list(dict.fromkeys(t for _, t in node.references()))

    def join_of(self, parallel_id: str) -> str:
        """The join node of the parallel ``parallel_id``. Raises ``KeyError`` if it is not a parallel."""
        node = self.nodes[parallel_id]
        if not isinstance(node, ParallelNode):
            raise KeyError(parallel_id)
        return node.join

    def parallel_of(self, join_id: str) -> str:
        """The parallel node whose join is ``join_id``. Raises ``KeyError`` if it is not a join."""
        return self._parallel_of[join_id]

    @property
    def joins(self) -> Mapping[str, str]:
        """Parallel id → its join id, for every parallel node."""
        return {p: j for j, p in self._parallel_of.items()}

    def enclosing_parallels(self, node_id: str) -> tuple[str, ...]:
        """The parallel blocks ``node_id`` lies in, outermost first (``()`` outside any).

        A parallel and its join lie in the enclosing block, not in their own. Raises ``KeyError``.
        """
        return self._blocks[node_id]

    def enclosing_parallel(self, node_id: str) -> str | None:
        """The innermost parallel whose branches contain ``node_id`` (the fork a token on it belongs
        to), or ``None`` outside any block. Raises ``KeyError`` for an unknown node."""
        stack = self._blocks[node_id]
        return stack[-1] if stack else None

    def canonical(self) -> dict[str, Any]:
        """The graph as stored and digested: :func:`canonical_graph`."""
        return canonical_graph(self)

    def digest(self) -> str:
        """:func:`canonical_graph_digest` of this graph."""
        return canonical_graph_digest(self)


def _where(stack: tuple[str, ...]) -> str:
    return f"inside parallel {stack[-1]!r}" if stack else "outside any parallel"


def canonical_graph(graph: FlowGraph | Mapping[str, Any]) -> dict[str, Any]:
    """The canonical form of a graph: what the server stores and digests, and returns as ``graph``.

    Every field left at its default is dropped (``retry_safe: false`` means the same as no
    ``retry_safe``), ``type`` is always written, a choice rule keeps exactly its test (``equals:
    null`` stays), and integral numbers are integers (``30.0`` → ``30``, RFC 8785). So two graphs
    that mean the same have the same canonical form, and a field added with a default in a later
    release leaves it unchanged. Validates a mapping first (``pydantic.ValidationError``).
    """
    if not isinstance(graph, FlowGraph):
        graph = FlowGraph.model_validate(graph)
    nodes: dict[str, Any] = {}
    for node_id, node in graph.nodes.items():
        data = node.model_dump(mode="json", exclude_defaults=True)
        data["type"] = node.type
        nodes[node_id] = data
    result: dict[str, Any] = canonical_json({"start": graph.start, "nodes": nodes})
    return result


def canonical_graph_digest(graph: FlowGraph | Mapping[str, Any]) -> str:
    """The graph's digest: SHA-256 (hex, 64 characters) of :func:`canonical_graph` as JSON text
    with sorted keys, no whitespace, UTF-8 (not ``\\u`` escapes). Publishing a graph whose digest is
    already a version of the flow returns that version. Validates a mapping first."""
    text = json.dumps(canonical_graph(graph), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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
