"""The console's picture of a flow instance (orbit_server.console.flowgraph): node states and layout."""

from __future__ import annotations

from typing import Any

from orbit_client import FlowGraph, FlowInstance
from orbit_server.console.flowgraph import NODE_WIDTH, instance_graph, node_edges

T0 = "2026-12-01T15:00:00Z"
GRAPH = FlowGraph.model_validate(
    {
        "start": "reserve",
        "nodes": {
            "reserve": {"type": "task", "queue": "orders", "handler": "reserve_stock", "next": "wait_cancel",
                        "on_failure": "released"},
            "wait_cancel": {"type": "signal", "signal": "cancel", "timeout_seconds": 2, "next": "released",
                            "on_timeout": "fanout"},
            "fanout": {"type": "parallel", "branches": ["receipt", "notify"], "join": "joined"},
            "receipt": {"type": "task", "queue": "orders", "handler": "receipt", "next": "joined"},
            "notify": {"type": "timer", "seconds": 5, "next": "joined"},
            "joined": {"type": "join", "next": "done"},
            "done": {"type": "end"},
            "released": {"type": "end", "status": "CANCELLED"},
        },
    }
)  # fmt: skip


def instance(tokens: list[dict[str, Any]], steps: list[dict[str, Any]]) -> FlowInstance:
    return FlowInstance.model_validate(
        {"id": "i-1", "namespace": "shop", "flow": "order", "version": 1, "status": "RUNNING", "input": {},
         "control_version": 1, "state_version": 4, "created_at": T0, "updated_at": T0, "tokens": tokens,
         "steps": steps}
    )  # fmt: skip


def token(node: str, state: str, **extra: Any) -> dict[str, Any]:
    return {"id": f"t-{node}", "node": node, "state": state, "activation": 1, **extra}


def step(node: str, status: str, task_id: str, created_at: str = T0, **extra: Any) -> dict[str, Any]:
    return {"node": node, "activation": 1, "token_id": f"t-{node}", "task_id": task_id, "status": status,
            "created_at": created_at, **extra}  # fmt: skip


def test_edges_of_every_kind() -> None:
    nodes = GRAPH.model_dump(mode="json")["nodes"]
    assert node_edges(nodes["reserve"]) == [("", "wait_cancel"), ("on_failure", "released")]
    assert node_edges(nodes["fanout"]) == [("branch", "receipt"), ("branch", "notify")]
    rule = {"type": "choice", "rules": [{"path": "$.input.a", "equals": 1, "next": "x"}], "default": "y"}
    assert node_edges(rule) == [("rule 1", "x"), ("default", "y")]


def test_a_fork_in_flight() -> None:
    view = instance_graph(
        GRAPH,
        instance(
            [token("fanout", "FORKED"), token("receipt", "WAITING", waiting_for="task", task_id="task-2"),
             token("joined", "ARRIVED"), token("wait_cancel", "DONE")],
            [step("reserve", "SUCCEEDED", "task-1"), step("receipt", "RUNNING", "task-2")],
        ),
    )  # fmt: skip
    states = {n.id: (n.state, n.detail) for n in view.nodes}
    assert states == {
        "reserve": ("done", "SUCCEEDED"),
        "wait_cancel": ("passed", ""),
        "fanout": ("forked", ""),
        "receipt": ("waiting", "task"),
        "notify": ("pending", ""),
        "joined": ("arrived", ""),
        "done": ("pending", ""),
        "released": ("pending", ""),
    }
    links = {n.id: n.task_id for n in view.nodes}
    assert links["reserve"] == "task-1" and links["receipt"] == "task-2" and links["notify"] is None


def test_the_newest_step_decides_and_history_marks_passed_nodes() -> None:
    later = "2026-12-01T15:00:05Z"
    view = instance_graph(
        GRAPH,
        instance([], [step("reserve", "SUCCEEDED", "task-b", later), step("reserve", "FAILED", "task-a")]),
        visited={"wait_cancel", "released"},
    )
    nodes = {n.id: n for n in view.nodes}
    assert nodes["reserve"].state == "done" and [s.task_id for s in nodes["reserve"].steps] == [
        "task-a",
        "task-b",
    ]
    assert nodes["released"].state == "passed" and nodes["done"].state == "pending"


def test_failed_review_and_poll_rounds() -> None:
    poll = FlowGraph.model_validate(
        {"start": "check", "nodes": {
            "check": {"type": "poll", "queue": "q", "handler": "h", "interval_seconds": 1, "max_rounds": 3,
                      "done_path": "$.result.done", "next": "done", "on_exhausted": "review"},
            "review": {"type": "task", "queue": "q", "handler": "ask", "next": "done"},
            "done": {"type": "end"}}}
    )  # fmt: skip
    view = instance_graph(
        poll,
        instance([], [step("check", "FAILED", "r1", round=1), step("check", "FAILED", "r2", "2026-12-01T15:00:01Z",
                                                                  round=2),
                      step("review", "NEEDS_REVIEW", "t9")]),
    )  # fmt: skip
    nodes = {n.id: n for n in view.nodes}
    assert nodes["check"].state == "failed" and [s.label for s in nodes["check"].steps] == [
        "round 1",
        "round 2",
    ]
    assert nodes["review"].state == "review"


def test_layout_columns_follow_the_distance_from_start() -> None:
    view = instance_graph(GRAPH)
    x = {n.id: n.x for n in view.nodes}
    assert (
        x["reserve"] < x["wait_cancel"] < x["fanout"] < x["receipt"] == x["notify"] < x["joined"] < x["done"]
    )
    assert x["released"] == x["wait_cancel"]  # one step from start, via on_failure
    assert max(x.values()) + NODE_WIDTH <= view.width
    assert all(n.state == "pending" for n in view.nodes)
    assert {(e.source, e.target) for e in view.edges} >= {("fanout", "receipt"), ("joined", "done")}
    assert all(e.path.startswith("M") for e in view.edges)


def test_a_loop_back_is_an_arc() -> None:
    loop = FlowGraph.model_validate(
        {"start": "work", "nodes": {
            "work": {"type": "task", "queue": "q", "handler": "h", "next": "again"},
            "again": {"type": "choice", "rules": [{"path": "$.steps.work.result.more", "equals": True,
                                                   "next": "work"}], "default": "done"},
            "done": {"type": "end"}}}
    )  # fmt: skip
    view = instance_graph(loop)
    back = [e for e in view.edges if e.back]
    assert [(e.source, e.target) for e in back] == [("again", "work")]
    assert view.height > max(n.y for n in view.nodes)
