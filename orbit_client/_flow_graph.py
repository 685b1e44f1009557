"""The flow graph and its validation: a published graph version (:class:`FlowGraph`) checked as a whole
(ids, edges, reachability, joins, templates), and its canonical form and digest.

The graph is validated here, by the model, so the client refuses a bad graph before sending it and the
server answers ``422 validation_error`` with the same message, which names the node at fault (README
"Flows: graph format"). The nodes are in :mod:`._flow_nodes`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Self

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from orbit_client._flow_nodes import (
    FLOW_MAX_NODES,
    EndNode,
    FlowNode,
    JoinNode,
    NodeId,
    ParallelNode,
    PollNode,
    TaskNode,
    _check_template,
)

from ._models import _Wire, canonical_json

__all__ = ["FlowGraph", "canonical_graph", "canonical_graph_digest"]


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
