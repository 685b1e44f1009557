"""Flow wire models (orbit_client._flow_models, issue 13): the graph format, its validation (errors name
the node), path syntax, the canonical form and digest, and the helpers the engine uses."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from pydantic import ValidationError

from orbit_client import (
    FLOW_PATH_MAX_SEGMENTS,
    ChoiceNode,
    ChoiceRule,
    EndNode,
    FlowGraph,
    FlowInstance,
    FlowInstanceStatus,
    FlowPublish,
    FlowSignal,
    FlowStart,
    FlowTokenState,
    FlowVersion,
    JoinNode,
    ParallelNode,
    PollNode,
    SignalNode,
    TaskNode,
    TimerNode,
    canonical_graph,
    canonical_graph_digest,
    parse_flow_path,
)

END = {"type": "end"}


def task(next_: str, **extra: Any) -> dict[str, Any]:
    return {"type": "task", "queue": "q", "handler": "h", "next": next_, **extra}


def timer(next_: str) -> dict[str, Any]:
    return {"type": "timer", "seconds": 1, "next": next_}


def spec_graph() -> dict[str, Any]:
    """The example of the flows contract, completed so that every node leads somewhere."""
    return {
        "start": "reserve",
        "nodes": {
            "reserve": {
                "type": "task",
                "queue": "orders",
                "handler": "reserve_stock",
                "params": {"order_id": "$.input.order_id", "note": {"$literal": "$.not-a-path"}},
                "max_attempts": 5,
                "retry_safe": True,
                "timeout_seconds": 30,
                "next": "wait_cancel",
                "on_failure": "released",
            },
            "wait_cancel": {
                "type": "signal",
                "signal": "cancel",
                "timeout_seconds": 2,
                "next": "released",
                "on_timeout": "remind",
            },
            "remind": {"type": "timer", "seconds": 5, "next": "remind2"},
            "remind2": {"type": "timer", "until": "$.input.remind_at", "next": "check"},
            "check": {
                "type": "poll",
                "queue": "q",
                "handler": "h",
                "params": {},
                "interval_seconds": 5,
                "max_rounds": 10,
                "deadline_seconds": 600,
                "done_path": "$.result.done",
                "next": "route",
                "on_exhausted": "released",
            },
            "route": {
                "type": "choice",
                "rules": [
                    {"path": "$.steps.reserve.result.big", "equals": True, "next": "fanout"},
                    {"path": "$.signals.cancel", "present": True, "next": "released"},
                ],
                "default": "fanout",
            },
            "fanout": {"type": "parallel", "branches": ["receipt", "notify"], "join": "joined"},
            "receipt": task("joined"),
            "notify": task("joined"),
            "joined": {"type": "join", "next": "done"},
            "done": {"type": "end", "output": {"order": "$.input.order_id"}},
            "released": {"type": "end", "status": "CANCELLED"},
        },
    }


def error_of(graph: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        FlowGraph.model_validate(graph)
    return "; ".join(e["msg"] for e in info.value.errors())


# -------------------------------------------------------------------------------------------- valid


def test_the_contracts_example_graph_is_valid_and_answers_the_engines_questions() -> None:
    graph = FlowGraph.model_validate(spec_graph())
    assert isinstance(graph.nodes["reserve"], TaskNode)
    assert isinstance(graph.nodes["wait_cancel"], SignalNode)
    assert isinstance(graph.nodes["remind2"], TimerNode)
    assert isinstance(graph.nodes["check"], PollNode)
    assert isinstance(graph.nodes["route"], ChoiceNode)
    assert isinstance(graph.nodes["fanout"], ParallelNode)
    assert isinstance(graph.nodes["joined"], JoinNode)
    assert isinstance(graph.nodes["released"], EndNode)
    assert graph.successors("reserve") == ["wait_cancel", "released"]
    assert graph.successors("route") == ["fanout", "released"]  # no repeats, in field order
    assert graph.successors("fanout") == ["receipt", "notify"]
    assert graph.successors("done") == []
    assert graph.join_of("fanout") == "joined"
    assert graph.parallel_of("joined") == "fanout"
    assert dict(graph.joins) == {"fanout": "joined"}
    assert graph.enclosing_parallel("receipt") == "fanout"
    assert graph.enclosing_parallel("notify") == "fanout"
    # The parallel and its join lie outside their own block.
    assert graph.enclosing_parallel("fanout") is None
    assert graph.enclosing_parallel("joined") is None
    assert graph.enclosing_parallels("reserve") == ()
    with pytest.raises(KeyError):
        graph.join_of("reserve")
    with pytest.raises(KeyError):
        graph.parallel_of("fanout")
    with pytest.raises(KeyError):
        graph.successors("nope")


def test_defaults_of_nodes() -> None:
    graph = FlowGraph.model_validate(spec_graph())
    receipt = graph.nodes["receipt"]
    assert isinstance(receipt, TaskNode)
    assert receipt.params == {}
    assert receipt.max_attempts is None  # the server's default
    assert receipt.retry_safe is False
    assert receipt.timeout_seconds is None
    assert receipt.on_failure is None
    done = graph.nodes["done"]
    assert isinstance(done, EndNode) and done.status == "COMPLETED"


def test_nested_parallel_blocks() -> None:
    graph = FlowGraph.model_validate(
        {
            "start": "outer",
            "nodes": {
                "outer": {"type": "parallel", "branches": ["a", "inner"], "join": "outer_join"},
                "a": timer("outer_join"),
                "inner": {"type": "parallel", "branches": ["b", "c"], "join": "inner_join"},
                "b": task("b2"),
                "b2": task("inner_join"),
                "c": timer("inner_join"),
                "inner_join": {"type": "join", "next": "after_inner"},
                "after_inner": task("outer_join"),
                "outer_join": {"type": "join", "next": "end"},
                "end": END,
            },
        }
    )
    assert graph.enclosing_parallels("b2") == ("outer", "inner")
    assert graph.enclosing_parallel("b2") == "inner"
    assert graph.enclosing_parallel("inner") == "outer"
    assert graph.enclosing_parallel("inner_join") == "outer"
    assert graph.enclosing_parallel("after_inner") == "outer"
    assert graph.enclosing_parallel("outer_join") is None
    assert dict(graph.joins) == {"outer": "outer_join", "inner": "inner_join"}


def test_loops_are_allowed_when_an_end_stays_reachable() -> None:
    # A retry loop around a whole parallel block, and a loop inside a branch.
    FlowGraph.model_validate(
        {
            "start": "fork",
            "nodes": {
                "fork": {"type": "parallel", "branches": ["a", "b"], "join": "joined"},
                "a": task("a_check"),
                "a_check": {
                    "type": "choice",
                    "rules": [{"path": "$.steps.a.result.ok", "equals": False, "next": "a"}],
                    "default": "joined",
                },
                "b": task("joined"),
                "joined": {"type": "join", "next": "again"},
                "again": {
                    "type": "choice",
                    "rules": [{"path": "$.input.repeat", "present": True, "next": "fork"}],
                    "default": "done",
                },
                "done": END,
            },
        }
    )


def test_two_branches_may_meet_inside_their_block() -> None:
    graph = FlowGraph.model_validate(
        {
            "start": "fork",
            "nodes": {
                "fork": {"type": "parallel", "branches": ["a", "b"], "join": "joined"},
                "a": task("shared"),
                "b": task("shared"),
                "shared": task("joined"),
                "joined": {"type": "join", "next": "done"},
                "done": END,
            },
        }
    )
    assert graph.enclosing_parallel("shared") == "fork"


def test_a_graph_built_from_node_objects() -> None:
    graph = FlowGraph(
        start="one",
        nodes={
            "one": TaskNode(queue="q", handler="h", params={"x": "$.input.x"}, next="route"),
            "route": ChoiceNode(
                rules=[ChoiceRule(path="$.steps.one.status", equals="FAILED", next="bad")], default="good"
            ),
            "good": EndNode(),
            "bad": EndNode(status="FAILED"),
        },
    )
    assert graph.successors("route") == ["bad", "good"]
    assert FlowGraph.model_validate(graph.canonical()) == graph


# -------------------------------------------------------------------------------- graph structure


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        ({"start": "nope", "nodes": {"a": END}}, "start 'nope' is not a node of the graph"),
        (
            {"start": "j", "nodes": {
                "j": {"type": "join", "next": "p"},
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("j"), "c": timer("j")}},
            "start 'j' is a join node",
        ),
        ({"start": "a", "nodes": {"a": task("zz"), "e": END}}, "node 'a': next 'zz' is not a node"),
        (
            {"start": "a", "nodes": {"a": task("e", on_failure="gone"), "e": END}},
            "node 'a': on_failure 'gone' is not a node",
        ),
        (
            {"start": "a", "nodes": {"a": timer("e"), "e": END, "lost": timer("e")}},
            "node 'lost' is not reachable from start 'a'",
        ),
        ({"start": "a", "nodes": {"a": timer("a"), "e": END}}, "node 'e' is not reachable"),
        (
            {"start": "a", "nodes": {"a": task("b", on_failure="e"), "b": timer("b"), "e": END}},
            "node 'b' cannot reach an end node",
        ),
        (
            {"start": "a", "nodes": {"a": {"type": "parallel", "branches": ["b", "c"], "join": "e"},
                                     "b": timer("e"), "c": timer("e"), "e": END}},
            "node 'a': join 'e' is an end node, not a join",
        ),
        (
            {"start": "a", "nodes": {"a": timer("j"), "j": {"type": "join", "next": "e"}, "e": END}},
            "join 'j' is the join of no parallel node",
        ),
        (
            {"start": "p", "nodes": {
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "q": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("j"), "c": timer("j"), "j": {"type": "join", "next": "e"}, "e": END}},
            "join 'j' is the join of both 'p' and 'q'",
        ),
        (
            {"start": "p", "nodes": {
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("e"), "c": timer("j"), "j": {"type": "join", "next": "e"}, "e": END}},
            "node 'b' (next) leads to end 'e' inside parallel 'p': a branch must reach its join 'j' first",
        ),
        (
            {"start": "p", "nodes": {
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("j"), "c": timer("c"), "j": {"type": "join", "next": "e"}, "e": END}},
            "node 'c' (in a branch of parallel 'p') cannot reach its join 'j'",
        ),
        (
            # A branch jumps out of its block to a node after the join.
            {"start": "p", "nodes": {
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("after"), "c": timer("j"), "j": {"type": "join", "next": "after"},
                "after": timer("e"), "e": END}},
            "node 'b' (next) leads to node 'after' inside parallel 'p', but it is also reached outside any "
            "parallel (from node 'j' (next))",
        ),
        (
            # A branch loops back to its own parallel.
            {"start": "p", "nodes": {
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("p"), "c": timer("j"), "j": {"type": "join", "next": "e"}, "e": END}},
            "leads to node 'p' inside parallel 'p', but it is also reached outside any parallel",
        ),
        (
            # An edge from outside into the join.
            {"start": "a", "nodes": {
                "a": task("p", on_failure="j"),
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("j"), "c": timer("j"), "j": {"type": "join", "next": "e"}, "e": END}},
            "node 'a' (on_failure) leads to join 'j' of parallel 'p' from outside any parallel",
        ),
        (
            # A branch of the inner block reaches the outer join first.
            {"start": "o", "nodes": {
                "o": {"type": "parallel", "branches": ["i", "x"], "join": "oj"},
                "i": {"type": "parallel", "branches": ["b", "c"], "join": "ij"},
                "b": timer("oj"), "c": timer("ij"), "ij": {"type": "join", "next": "oj"},
                "x": timer("oj"), "oj": {"type": "join", "next": "e"}, "e": END}},
            "node 'b' (next) leads to join 'oj' of parallel 'o' from inside parallel 'i'",
        ),
        (
            # An edge from outside into a branch.
            {"start": "a", "nodes": {
                "a": task("p", on_failure="c"),
                "p": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
                "b": timer("j"), "c": timer("j"), "j": {"type": "join", "next": "e"}, "e": END}},
            "node 'c' (next) leads to join 'j' of parallel 'p' from outside any parallel",
        ),
        (
            {"start": "a", "nodes": {"a": task("e", params={"x": "$.steps.e.result"}), "e": END}},
            "node 'a': params: path '$.steps.e.result' names 'e', which is not a task or poll node",
        ),
        (
            {"start": "a", "nodes": {"a": {"type": "end", "output": "$.steps.zz.result"}}},
            "node 'a': output: path '$.steps.zz.result' names 'zz'",
        ),
        (
            {"start": "a", "nodes": {
                "a": {"type": "choice", "rules": [{"path": "$.steps.b.result", "present": True, "next": "e"}],
                      "default": "e"}, "e": END}},
            "node 'a': rules[0].path: path '$.steps.b.result' names 'b'",
        ),
        (
            {"start": "a", "nodes": {
                "a": {"type": "choice", "rules": [{"path": "$.input.x", "present": True, "next": "zz"}],
                      "default": "e"}, "e": END}},
            "node 'a': rules[0].next 'zz' is not a node",
        ),
    ],
)  # fmt: skip
def test_structural_errors_name_the_node(graph: dict[str, Any], message: str) -> None:
    assert message in error_of(graph)


def test_node_ids_follow_the_pattern() -> None:
    assert "should match pattern" in error_of({"start": "Start", "nodes": {"Start": END}})
    assert "should match pattern" in error_of({"start": "a", "nodes": {"a": task("B-1"), "B-1": END}})
    FlowGraph.model_validate({"start": "a" * 64, "nodes": {"a" * 64: END}})
    error_of({"start": "a" * 65, "nodes": {"a" * 65: END}})


def test_a_graph_needs_nodes_and_a_known_type() -> None:
    error_of({"start": "a", "nodes": {}})
    assert "does not match any of the expected tags" in error_of(
        {"start": "a", "nodes": {"a": {"type": "x"}}}
    )
    assert "Extra inputs are not permitted" in error_of(
        {"start": "a", "nodes": {"a": task("e", bogus=1), "e": END}}
    )
    error_of({"start": "a", "nodes": {"a": END}, "extra": 1})


# --------------------------------------------------------------------------------------- node rules


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"type": "timer", "next": "e"}, "exactly one of seconds and until"),
        ({"type": "timer", "seconds": 1, "until": "$.input.t", "next": "e"}, "exactly one of seconds and until"),
        ({"type": "timer", "seconds": 0, "next": "e"}, "greater than 0"),
        ({"type": "timer", "seconds": 366 * 86400 + 1, "next": "e"}, "less than or equal"),
        ({"type": "timer", "seconds": "5", "next": "e"}, "valid"),
        ({"type": "timer", "seconds": True, "next": "e"}, "valid"),
        ({"type": "timer", "until": "input.t", "next": "e"}, "must start with '$'"),
        ({"type": "timer", "until": "$.result.t", "next": "e"}, "must start with $.input, $.steps"),
        ({"type": "signal", "signal": "cancel", "timeout_seconds": 2, "next": "e"}, "both timeout_seconds"),
        ({"type": "signal", "signal": "cancel", "on_timeout": "e", "next": "e"}, "both timeout_seconds"),
        ({"type": "signal", "signal": "Cancel", "next": "e"}, "should match pattern"),
        ({"type": "parallel", "branches": ["e"], "join": "e"}, "at least 2 items"),
        ({"type": "parallel", "branches": ["e", "e"], "join": "e"}, "branches must be distinct"),
        (task("e", max_attempts=0), "greater than or equal to 1"),
        (task("e", max_attempts=101), "less than or equal to 100"),
        (task("e", max_attempts="3"), "valid integer"),
        (task("e", retry_safe="yes"), "valid boolean"),
        (task("e", timeout_seconds=-1), "greater than 0"),
        (task("e", queue="bad queue"), "should match pattern"),
        (task("e", handler="has space"), "should match pattern"),
        (task("e", concurrency_key="has space"), "should match pattern"),
        (task("e", concurrency_key="$.input.a b"), "malformed"),
        (task("e", concurrency_key="$.nope.x"), "must start with $.input"),
        (task("e", params={"x": "$.input..x"}), "malformed"),
        (task("e", params={"$x": 1}), "keys starting with '$' are reserved"),
        (task("e", params={"$literal": 1, "y": 2}), "no other key"),
        (task("e", params={"x": "$.instance.secret"}), "$.instance has only id, flow and version"),
        (task("e", params={"x": "$.steps.a.output"}), "a step has only status, result and error"),
        (task("e", params={"x": "$.steps[0]"}), "followed by a node id"),
        (task("e", params=float("nan")), "NaN"),
        ({"type": "poll", "queue": "q", "handler": "h", "interval_seconds": 1, "max_rounds": 0,
          "done_path": "$.result.done", "next": "e"}, "greater than or equal to 1"),
        ({"type": "poll", "queue": "q", "handler": "h", "interval_seconds": 1, "max_rounds": 10001,
          "done_path": "$.result.done", "next": "e"}, "less than or equal to 10000"),
        ({"type": "poll", "queue": "q", "handler": "h", "interval_seconds": 1, "max_rounds": 3,
          "done_path": "$.input.done", "next": "e"}, "must start with $.result"),
        ({"type": "poll", "queue": "q", "handler": "h", "max_rounds": 3,
          "done_path": "$.result.done", "next": "e"}, "Field required"),
        ({"type": "choice", "rules": [], "default": "e"}, "at least 1 item"),
        ({"type": "choice", "rules": [{"path": "$.input.x", "next": "e"}], "default": "e"}, "exactly one of equals"),
        ({"type": "choice", "rules": [{"path": "$.input.x", "equals": 1, "present": True, "next": "e"}],
          "default": "e"}, "exactly one of equals"),
        ({"type": "choice", "rules": [{"path": "$.input.x", "equals": 1, "next": "e"}]}, "Field required"),
        ({"type": "end", "status": "RUNNING"}, "Input should be"),
    ],
)  # fmt: skip
def test_node_rules(node: dict[str, Any], message: str) -> None:
    graph = {"start": "a", "nodes": {"a": node, "e": END}}
    assert message in error_of(graph)


def test_a_choice_rule_may_compare_with_null() -> None:
    rule = ChoiceRule.model_validate({"path": "$.input.x", "equals": None, "next": "e"})
    assert not rule.tests_presence
    assert rule.model_dump(mode="json") == {"path": "$.input.x", "equals": None, "next": "e"}
    presence = ChoiceRule.model_validate({"path": "$.input.x", "present": False, "next": "e"})
    assert presence.tests_presence
    assert presence.model_dump(mode="json") == {"path": "$.input.x", "present": False, "next": "e"}
    # A full dump validates again to the same rule.
    assert ChoiceRule.model_validate(rule.model_dump(mode="json")) == rule


# ------------------------------------------------------------------------------------------ paths


@pytest.mark.parametrize(
    ("path", "segments"),
    [
        ("$.input", ("input",)),
        ("$.input.a.b", ("input", "a", "b")),
        ("$.input.items[0]", ("input", "items", 0)),
        ("$.input.items[12][3].x", ("input", "items", 12, 3, "x")),
        ("$.steps.reserve.result.x-y_z", ("steps", "reserve", "result", "x-y_z")),
        ("$._private", ("_private",)),
    ],
)
def test_paths_parse(path: str, segments: tuple[str | int, ...]) -> None:
    assert parse_flow_path(path) == segments


@pytest.mark.parametrize(
    "path",
    ["", "$", "input.a", "$.", "$..a", "$.a.", "$.1a", "$.a[01]", "$.a[-1]", "$.a[x]", "$[0]", "$.a b",
     "$.a.$b", "$.a[0", "$.é"],
)  # fmt: skip
def test_malformed_paths(path: str) -> None:
    with pytest.raises(ValueError, match="path"):
        parse_flow_path(path)


def test_path_segment_limit() -> None:
    longest = "$.input" + ".a" * (FLOW_PATH_MAX_SEGMENTS - 1)
    assert len(parse_flow_path(longest)) == FLOW_PATH_MAX_SEGMENTS
    with pytest.raises(ValueError, match="more than 32 segments"):
        parse_flow_path(longest + "[0]")


def test_literal_templates_are_not_checked() -> None:
    node = TaskNode(
        queue="q", handler="h", params={"raw": {"$literal": {"$weird": "$.not a path"}}}, next="e"
    )
    assert node.params == {"raw": {"$literal": {"$weird": "$.not a path"}}}
    # A string beginning with "$" but not "$." is a plain string.
    TaskNode(queue="q", handler="h", params={"price": "$5", "x": "$"}, next="e")


# ----------------------------------------------------------------------------- canonical form


def test_canonical_form_drops_defaults_keeps_type_and_writes_integral_numbers_as_integers() -> None:
    graph = {
        "start": "a",
        "nodes": {
            "a": task("c", retry_safe=False, params={}, timeout_seconds=30.0, max_attempts=None),
            "c": {
                "type": "choice",
                "rules": [{"path": "$.input.x", "equals": None, "next": "e"}],
                "default": "e",
            },
            "e": {"type": "end", "status": "COMPLETED"},
        },
    }
    assert canonical_graph(graph) == {
        "start": "a",
        "nodes": {
            "a": {"type": "task", "queue": "q", "handler": "h", "timeout_seconds": 30, "next": "c"},
            "c": {"type": "choice", "rules": [{"path": "$.input.x", "equals": None, "next": "e"}], "default": "e"},
            "e": {"type": "end"},
        },
    }  # fmt: skip


def test_digest_is_stable_across_spelling_and_changes_with_meaning() -> None:
    base = spec_graph()
    digest = canonical_graph_digest(base)
    assert len(digest) == 64 and int(digest, 16) >= 0
    # Key order, explicit defaults and 30 vs 30.0 do not change it.
    respelled = json.loads(json.dumps(base, sort_keys=True))
    respelled["nodes"] = dict(reversed(list(respelled["nodes"].items())))
    respelled["nodes"]["receipt"]["retry_safe"] = False
    respelled["nodes"]["reserve"]["timeout_seconds"] = 30.0
    respelled["nodes"]["done"]["status"] = "COMPLETED"
    assert canonical_graph_digest(respelled) == digest
    # A model, its dump and its canonical form agree.
    graph = FlowGraph.model_validate(base)
    assert graph.digest() == digest
    assert canonical_graph_digest(FlowGraph.model_validate(graph.model_dump(mode="json"))) == digest
    assert canonical_graph_digest(FlowGraph.model_validate_json(graph.model_dump_json())) == digest
    assert canonical_graph_digest(graph.canonical()) == digest
    # Any change of meaning changes it.
    for change in (
        lambda g: g["nodes"]["reserve"].update(max_attempts=4),
        lambda g: g["nodes"]["reserve"]["params"].update(extra=1),
        lambda g: g["nodes"]["fanout"].update(branches=["notify", "receipt"]),
        lambda g: g["nodes"]["route"]["rules"].reverse(),
        lambda g: g["nodes"]["receipt"].update(retry_safe=True),
    ):
        changed = copy.deepcopy(base)
        change(changed)
        assert canonical_graph_digest(changed) != digest


def test_digest_is_sha256_of_sorted_compact_utf8_json() -> None:
    import hashlib

    graph = {"start": "a", "nodes": {"a": {"type": "end", "output": "é"}}}
    text = '{"nodes":{"a":{"output":"é","type":"end"}},"start":"a"}'
    assert canonical_graph_digest(graph) == hashlib.sha256(text.encode()).hexdigest()


def _random_block(rng: random.Random, nodes: dict[str, Any], after: str, depth: int) -> str:
    """Add a random well-formed segment ending at ``after``; return its first node."""
    kind = rng.choice(
        ["task", "timer", "signal", "poll", "choice", "parallel"] if depth < 3 else ["task", "timer"]
    )
    node_id = f"n{len(nodes)}"
    nodes[node_id] = None  # reserve the id
    if kind == "parallel":
        join = f"n{len(nodes)}"
        nodes[join] = {"type": "join", "next": after}
        branches = [_random_block(rng, nodes, join, depth + 1) for _ in range(rng.randint(2, 3))]
        nodes[node_id] = {"type": "parallel", "branches": branches, "join": join}
    elif kind == "choice":
        other = _random_block(rng, nodes, after, depth + 1)
        nodes[node_id] = {
            "type": "choice",
            "rules": [{"path": "$.input.x", "equals": 1, "next": other}],
            "default": after,
        }
    elif kind == "poll":
        nodes[node_id] = {"type": "poll", "queue": "q", "handler": "h", "interval_seconds": 1, "max_rounds": 2,
                          "done_path": "$.result.done", "next": after}  # fmt: skip
    elif kind == "signal":
        nodes[node_id] = {"type": "signal", "signal": "go", "next": after}
    elif kind == "timer":
        nodes[node_id] = timer(after)
    else:
        nodes[node_id] = task(after)
    return node_id


@pytest.mark.parametrize("seed", range(40))
def test_random_well_formed_graphs_validate_and_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    nodes: dict[str, Any] = {"end": END}
    first = "end"
    for _ in range(rng.randint(1, 4)):
        first = _random_block(rng, nodes, first, 0)
    graph = FlowGraph.model_validate({"start": first, "nodes": nodes})
    again = FlowGraph.model_validate(json.loads(json.dumps(graph.canonical())))
    assert again == graph and again.digest() == graph.digest()
    for node_id, node in graph.nodes.items():
        if isinstance(node, ParallelNode):
            for branch in node.branches:
                assert graph.enclosing_parallel(branch) == node_id
            assert graph.enclosing_parallel(node.join) == graph.enclosing_parallel(node_id)


# --------------------------------------------------------------------------- requests, responses


def test_publish_start_signal_bodies() -> None:
    publish = FlowPublish.model_validate({"graph": spec_graph(), "description": "v1"})
    assert publish.graph.start == "reserve"
    with pytest.raises(ValidationError):
        FlowPublish.model_validate({"graph": spec_graph(), "description": ""})

    start = FlowStart.model_validate({})
    assert start.input == {} and start.version is None
    assert FlowStart(input={"a": 1.0}).canonical_meaning() == {"input": {"a": 1}, "version": None}
    assert FlowStart(input={"a": 1}, version=3).canonical_meaning() == {"input": {"a": 1}, "version": 3}
    for bad in (
        {"input": [1]},
        {"input": "x"},
        {"version": 0},
        {"version": "1"},
        {"input": {"x": float("inf")}},
    ):
        with pytest.raises(ValidationError):
            FlowStart.model_validate(bad)

    signal = FlowSignal(name="order.cancelled-v2", payload={"why": 1.0})
    assert signal.canonical_meaning() == {"name": "order.cancelled-v2", "payload": {"why": 1}}
    with pytest.raises(ValidationError):
        FlowSignal(name="Cancel")


def test_responses_parse_and_ignore_unknown_fields() -> None:
    now = "2026-12-01T15:00:00Z"
    instance = FlowInstance.model_validate(
        {
            "id": "i1", "namespace": "ns", "flow": "orders", "version": 2, "status": "RUNNING",
            "paused": False, "input": {"order_id": 7}, "idempotency_key": "k", "control_version": 1,
            "state_version": 3, "created_at": now, "updated_at": now, "pending_events": 1,
            "tokens": [{"id": "t1", "node": "reserve", "state": "WAITING", "activation": 1,
                        "task_id": "x", "waiting_for": "task", "fire_at": None, "new_field": 1}],
            "steps": [{"node": "reserve", "activation": 1, "token_id": "t1", "task_id": "x",
                       "status": "RUNNING", "created_at": now}],
            "added_later": True,
        }
    )  # fmt: skip
    assert instance.status is FlowInstanceStatus.RUNNING and not instance.status.is_terminal
    assert instance.tokens[0].state is FlowTokenState.WAITING and not instance.tokens[0].state.is_final
    assert instance.steps[0].round is None and instance.pending_events == 1
    version = FlowVersion.model_validate(
        {"namespace": "ns", "flow": "orders", "version": 1, "digest": canonical_graph_digest(spec_graph()),
         "graph": canonical_graph(spec_graph()), "published_at": now}
    )  # fmt: skip
    assert version.graph.digest() == version.digest
    assert {s.value for s in FlowInstanceStatus if s.is_terminal} == {"COMPLETED", "FAILED", "CANCELLED"}
    assert {s.value for s in FlowTokenState if s.is_final} == {"DONE", "CANCELLED"}


# ------------------------------------------------------------------------------------------ README


def _readme_section() -> str:
    """The docs' page of the graph format (reference/flow-graph.md; it was the README's "Flows: graph format")."""
    from tests.docs_pages import page

    return page("reference/flow-graph.md")


def test_the_readme_example_graph_is_valid() -> None:
    import re

    blocks = re.findall(r"```json\n(.*?)```", _readme_section(), flags=re.S)
    assert len(blocks) == 1
    graph = FlowGraph.model_validate_json(blocks[0])
    assert {node.type for node in graph.nodes.values()} == {
        "task", "signal", "timer", "parallel", "join", "poll", "choice", "end"
    }  # fmt: skip
    assert graph.enclosing_parallel("notify") == "fanout"


def test_the_readme_documents_every_node_type_and_field() -> None:
    section = _readme_section()
    for model in (TaskNode, TimerNode, SignalNode, ParallelNode, JoinNode, PollNode, ChoiceNode, EndNode):
        type_name = model.model_fields["type"].default
        assert f"| `{type_name}` |" in section, f"README: no row for {type_name}"
        for field in model.model_fields:
            assert f"`{field}`" in section, f"README: field {field} of {type_name} is not documented"
    for field in ChoiceRule.model_fields:
        assert f"`{field}`" in section


def test_json_schemas_describe_the_wire_in_both_directions() -> None:
    """The OpenAPI document is built from these models: a dumped choice rule keeps its shape."""
    out = FlowVersion.model_json_schema(mode="serialization")
    rule = out["$defs"]["ChoiceRuleDump"]
    assert rule["required"] == ["path", "next"] and set(rule["properties"]) == {
        "path",
        "equals",
        "present",
        "next",
    }
    assert "nodes" in out["$defs"]["FlowGraph"]["properties"]
    inp = FlowPublish.model_json_schema()
    assert set(inp["$defs"]["ChoiceRule"]["properties"]) == {"path", "equals", "present", "next"}
