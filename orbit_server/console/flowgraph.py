"""The picture of a flow instance for the console: each node of its version's graph with its state.

Pure functions, no I/O: :func:`instance_graph` takes the graph (``FlowVersion.graph``) and the
instance (``FlowInstance``, with tokens and steps) and returns the nodes with positions, a state
and the step tasks to link to, and the edges; the template draws them as inline SVG (no script:
the console's Content-Security-Policy allows none) and as a table.

A node's state, first rule that applies:

1. a token is on it: ``active`` (ACTIVE), ``waiting`` (WAITING, with what it waits for), ``forked``
   (a parallel's parent token), ``arrived`` (a branch token waiting at its join);
2. it has steps (task or poll rounds): the newest step's task status decides: ``done``
   (SUCCEEDED), ``failed``, ``cancelled``, ``review`` (NEEDS_REVIEW), else ``active``;
3. a finished token was on it, or the history names it: ``passed``;
4. only cancelled tokens were on it: ``cancelled``;
5. else ``pending`` (not reached).

The layout is layered: a node's column is its distance from ``start`` (breadth first, so a
loop's way back is drawn as an arc under the nodes); rows follow the order nodes are found.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EdgeView", "GraphView", "NodeView", "instance_graph", "node_edges"]

NODE_WIDTH = 180
NODE_HEIGHT = 56
COLUMN_GAP = 60
ROW_GAP = 26
MARGIN = 16
ARC_DROP = 34  # how far under the lowest node a way back is drawn, in SVG units

_STEP_STATES = {"SUCCEEDED": "done", "FAILED": "failed", "CANCELLED": "cancelled", "NEEDS_REVIEW": "review"}
_TOKEN_STATES = {"ACTIVE": "active", "WAITING": "waiting", "FORKED": "forked", "ARRIVED": "arrived"}
#: Edge fields of the node types, in drawing order; ``next`` is unlabelled.
_EDGE_FIELDS = ("next", "on_failure", "on_timeout", "on_exhausted", "default")


@dataclass(frozen=True)
class StepLink:
    task_id: str
    status: str
    label: str  # "activation 2", "round 3"


@dataclass
class NodeView:
    id: str
    type: str
    summary: str
    state: str = "pending"
    detail: str = ""
    x: int = 0
    y: int = 0
    steps: list[StepLink] = field(default_factory=list)

    @property
    def task_id(self) -> str | None:
        """The newest step's task, the one the node links to."""
        return self.steps[-1].task_id if self.steps else None


@dataclass(frozen=True)
class EdgeView:
    source: str
    target: str
    label: str
    path: str  # SVG path data
    label_x: int
    label_y: int
    back: bool


@dataclass(frozen=True)
class GraphView:
    nodes: list[NodeView]
    edges: list[EdgeView]
    width: int
    height: int


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def node_edges(node: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, target)`` of every edge out of a node (a mapping as the graph JSON holds it)."""
    edges: list[tuple[str, str]] = []
    for branch in node.get("branches") or ():
        edges.append(("branch", branch))
    for index, rule in enumerate(node.get("rules") or ()):
        if isinstance(rule, Mapping) and rule.get("next"):
            edges.append((f"rule {index + 1}", rule["next"]))
    for name in _EDGE_FIELDS:
        target = node.get(name)
        if isinstance(target, str) and target:
            edges.append(("" if name == "next" else name, target))
    return edges


def _summary(node: Mapping[str, Any]) -> str:
    kind = node.get("type", "?")
    if kind in ("task", "poll"):
        text = f"{node.get('queue', '?')} · {node.get('handler', '?')}"
        return text if kind == "task" else f"{text} · ≤{node.get('max_rounds', '?')} rounds"
    if kind == "timer":
        return (
            f"{node['seconds']:g} s" if node.get("seconds") is not None else f"until {node.get('until', '?')}"
        )
    if kind == "signal":
        timeout = node.get("timeout_seconds")
        return f"signal {node.get('signal', '?')}" + (f" · {timeout:g} s" if timeout is not None else "")
    if kind == "parallel":
        return f"{len(node.get('branches') or ())} branches"
    if kind == "choice":
        return f"{len(node.get('rules') or ())} rules"
    if kind == "end":
        return str(node.get("status") or "COMPLETED")
    return ""


def _layers(start: str, nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    depth = {start: 0} if start in nodes else {}
    queue = deque(depth)
    while queue:
        current = queue.popleft()
        for _, target in node_edges(nodes[current]):
            if target in nodes and target not in depth:
                depth[target] = depth[current] + 1
                queue.append(target)
    last = max(depth.values(), default=-1) + 1
    for name in nodes:  # unreachable nodes (a valid graph has none) go in a last column
        depth.setdefault(name, last)
    return depth


def _states(view: dict[str, NodeView], instance: Any, visited: Iterable[str]) -> None:
    tokens = [_plain(t) for t in getattr(instance, "tokens", None) or ()]
    steps = [_plain(s) for s in getattr(instance, "steps", None) or ()]
    live: dict[str, tuple[str, str]] = {}
    finished: set[str] = set()
    cancelled: set[str] = set()
    for token in tokens:
        node, state = token.get("node"), str(token.get("state"))
        if node not in view:
            continue
        if state in _TOKEN_STATES:
            if node not in live or live[node][0] != "active":
                live[node] = (_TOKEN_STATES[state], str(token.get("waiting_for") or ""))
        elif state == "DONE":
            finished.add(node)
        elif state == "CANCELLED":
            cancelled.add(node)
    for step in sorted(steps, key=lambda s: (str(s.get("created_at") or ""), s.get("activation") or 0)):
        node = step.get("node")
        if node in view and step.get("task_id"):
            label = (
                f"round {step['round']}"
                if step.get("round") is not None
                else f"activation {step.get('activation')}"
            )
            view[node].steps.append(StepLink(str(step["task_id"]), str(step.get("status") or ""), label))
    seen = set(visited)
    for name, node in view.items():
        if name in live:
            node.state, node.detail = live[name]
        elif node.steps:
            status = node.steps[-1].status
            node.state = _STEP_STATES.get(status, "active")
            node.detail = status
        elif name in finished or name in seen:
            node.state = "passed"
        elif name in cancelled:
            node.state = "cancelled"


def instance_graph(graph: Any, instance: Any = None, visited: Iterable[str] = ()) -> GraphView:
    """Lay out ``graph`` (a ``FlowGraph`` or its JSON) with the state of each node in ``instance``.

    Args:
        graph: ``{"start": id, "nodes": {id: node}}`` or the model.
        instance: a ``FlowInstance`` (its ``tokens`` and ``steps`` are read); ``None``: all pending.
        visited: node ids the instance's history names (a node passed without a step or token left).

    Returns:
        The nodes (in column, then row order) and edges, with the SVG canvas size.
    """
    data = _plain(graph) or {}
    nodes: dict[str, dict[str, Any]] = {k: _plain(v) for k, v in (data.get("nodes") or {}).items()}
    depth = _layers(str(data.get("start", "")), nodes)
    rows: dict[int, int] = {}
    view: dict[str, NodeView] = {}
    for name in sorted(nodes, key=lambda n: depth[n]):  # stable: discovery order within a column
        column = depth[name]
        row = rows.get(column, 0)
        rows[column] = row + 1
        view[name] = NodeView(
            id=name,
            type=str(nodes[name].get("type", "?")),
            summary=_summary(nodes[name]),
            x=MARGIN + column * (NODE_WIDTH + COLUMN_GAP),
            y=MARGIN + row * (NODE_HEIGHT + ROW_GAP),
        )
    _states(view, instance, visited)
    height = MARGIN * 2 + max(rows.values(), default=1) * (NODE_HEIGHT + ROW_GAP) - ROW_GAP
    bottom = height - MARGIN
    edges: list[EdgeView] = []
    arcs = 0
    for name, node in nodes.items():
        source = view[name]
        for label, target_name in node_edges(node):
            target = view.get(target_name)
            if target is None:
                continue
            sx, sy = source.x + NODE_WIDTH, source.y + NODE_HEIGHT // 2
            tx, ty = target.x, target.y + NODE_HEIGHT // 2
            back = target.x < source.x
            if target.x == source.x:  # same column: down (or up) the column's right side
                sx, tx = source.x + NODE_WIDTH - 24, target.x + NODE_WIDTH - 24
                down = target.y > source.y
                sy = source.y + (NODE_HEIGHT if down else 0)
                ty = target.y + (0 if down else NODE_HEIGHT)
                bend = sx + 40
                path = f"M{sx},{sy} C{bend},{sy} {bend},{ty} {tx},{ty + (-6 if down else 6)}"
                lx, ly = bend, (sy + ty) // 2
            elif back:  # a way back: an arc from under the source to under the target
                arcs += 1
                drop = bottom + ARC_DROP * arcs
                sx, sy = source.x + NODE_WIDTH // 2, source.y + NODE_HEIGHT
                tx, ty = target.x + NODE_WIDTH // 2 + 8, target.y + NODE_HEIGHT
                path = f"M{sx},{sy} C{sx},{drop} {tx},{drop} {tx},{ty + 6}"
                lx, ly = (sx + tx) // 2, drop - 4
            else:
                mid = (sx + tx) // 2
                path = f"M{sx},{sy} C{mid},{sy} {mid},{ty} {tx - 6},{ty}"
                lx, ly = mid, (sy + ty) // 2 - 4
            edges.append(EdgeView(name, target_name, label, path, lx, ly, back))
    columns = max(depth.values(), default=0) + 1
    width = MARGIN * 2 + columns * (NODE_WIDTH + COLUMN_GAP) - COLUMN_GAP
    return GraphView(
        nodes=sorted(view.values(), key=lambda n: (n.x, n.y)),
        edges=edges,
        width=width,
        height=height + ARC_DROP * arcs + (8 if arcs else 0),
    )
