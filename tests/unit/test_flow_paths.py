"""Path resolution and template rendering of flows (orbit_server.flows.paths, issue 13)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from orbit_client import JSON_MAX_DEPTH, ChoiceNode
from orbit_server.flows.paths import (
    FlowPathError,
    PathMissing,
    PathValueError,
    Scope,
    choose,
    is_present,
    json_equal,
    make_scope,
    poll_done,
    render,
    render_concurrency_key,
    resolve,
    resolve_time,
)


@pytest.fixture
def scope() -> Scope:
    return make_scope(
        input={
            "order_id": 7,
            "items": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": None}],
            "remind_at": "2026-12-01T16:00:00+01:00",
            "customer": "c-42",
            "nothing": None,
        },
        instance_id="i-1",
        flow="orders",
        version=3,
        steps={"reserve": {"status": "SUCCEEDED", "result": {"big": True, "ids": [5, 6]}, "error": None}},
        signals={"cancel": {"reason": "changed mind"}, "ping": None},
    )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("$.input.order_id", 7),
        ("$.input.items[0].sku", "a"),
        ("$.input.items[1].qty", None),
        ("$.input.nothing", None),
        ("$.steps.reserve.status", "SUCCEEDED"),
        ("$.steps.reserve.result.ids[1]", 6),
        ("$.steps.reserve.error", None),
        ("$.signals.cancel.reason", "changed mind"),
        ("$.signals.ping", None),
        ("$.instance.id", "i-1"),
        ("$.instance.flow", "orders"),
        ("$.instance.version", 3),
    ],
)
def test_resolve(scope: Scope, path: str, value: Any) -> None:
    assert resolve(path, scope) == value
    assert is_present(path, scope)


def test_resolve_gives_whole_values(scope: Scope) -> None:
    assert resolve("$.input.items", scope) == [{"sku": "a", "qty": 2}, {"sku": "b", "qty": None}]
    assert resolve("$.steps.reserve", scope)["result"] == {"big": True, "ids": [5, 6]}


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("$.input.missing", "$.input is an object without 'missing'"),
        ("$.input.items[2]", "$.input.items has 2 items, no [2]"),
        ("$.input.items.sku", "$.input.items is an array without 'sku'"),
        ("$.input.order_id[0]", "$.input.order_id is a number, not an array"),
        ("$.input.order_id.x", "$.input.order_id is a number without 'x'"),
        ("$.input.customer[0]", "$.input.customer is a string, not an array"),
        ("$.input.nothing.x", "$.input.nothing is null without 'x'"),
        ("$.steps.charge.result", "no step of node 'charge' has finished"),
        ("$.signals.approve", "no signal 'approve' was received"),
    ],
)
def test_missing_paths_say_where_they_stopped(scope: Scope, path: str, why: str) -> None:
    with pytest.raises(PathMissing) as info:
        resolve(path, scope)
    assert info.value.code == "flow_path_missing"
    assert info.value.path == path
    assert str(info.value) == f"path {path} is missing: {why}"
    assert not is_present(path, scope)


def test_a_malformed_path_is_a_value_error(scope: Scope) -> None:
    with pytest.raises(ValueError, match="malformed"):
        resolve("$.input..x", scope)


def test_render(scope: Scope) -> None:
    template = {
        "order_id": "$.input.order_id",
        "first": "$.input.items[0]",
        "nested": [{"qty": "$.input.items[1].qty"}, 1, True, None, 2.5],
        "literal": {"$literal": "$.input.order_id"},
        "literal_object": {"$literal": {"$op": ["$.x"]}},
        "plain": "order $.input.order_id",  # no interpolation: only a string *starting* with "$."
        "dollar": "$5",
    }
    assert render(template, scope) == {
        "order_id": 7,
        "first": {"sku": "a", "qty": 2},
        "nested": [{"qty": None}, 1, True, None, 2.5],
        "literal": "$.input.order_id",
        "literal_object": {"$op": ["$.x"]},
        "plain": "order $.input.order_id",
        "dollar": "$5",
    }
    assert render("$.instance.id", scope) == "i-1"
    assert render(None, scope) is None
    assert render({}, scope) == {}


def test_render_does_not_change_the_template(scope: Scope) -> None:
    template = {"a": ["$.input.order_id"]}
    render(template, scope)
    assert template == {"a": ["$.input.order_id"]}


def test_render_names_the_node_of_a_missing_path(scope: Scope) -> None:
    with pytest.raises(PathMissing) as info:
        render({"x": ["$.steps.charge.result.id"]}, scope, node="receipt")
    error = info.value
    assert error.node == "receipt" and error.path == "$.steps.charge.result.id"
    assert (
        str(error)
        == "node 'receipt': path $.steps.charge.result.id is missing: no step of node 'charge' has finished"
    )
    assert error.as_error() == {
        "code": "flow_path_missing",
        "message": str(error),
        "node": "receipt",
        "path": "$.steps.charge.result.id",
    }
    assert isinstance(error, FlowPathError)


def test_render_refuses_json_orbit_cannot_store() -> None:
    deep: Any = 1
    for _ in range(JSON_MAX_DEPTH - 1):
        deep = [deep]
    scope = make_scope(input={"deep": deep}, instance_id="i", flow="f", version=1)  # as deep as input may be
    assert render({"wrapped": "$.input.deep"}, scope) == {"wrapped": deep}
    with pytest.raises(PathValueError, match="not storable JSON") as info:
        render({"wrapped": ["$.input.deep"]}, scope, node="n")
    assert info.value.code == "flow_path_invalid_value" and info.value.node == "n"


def test_concurrency_key(scope: Scope) -> None:
    assert render_concurrency_key(None, scope) is None
    assert render_concurrency_key("fixed-key", scope) == "fixed-key"
    assert render_concurrency_key("$.input.customer", scope) == "c-42"
    assert render_concurrency_key("$.input.order_id", scope) == "7"
    for path, why in [
        ("$.input.items", "is an array, not a string or an integer"),
        ("$.input.nothing", "is null, not a string or an integer"),
        ("$.steps.reserve.result.big", "is a boolean, not a string or an integer"),
    ]:
        with pytest.raises(PathValueError, match=why) as info:
            render_concurrency_key(path, scope, node="reserve")
        assert info.value.node == "reserve"
    spaced = make_scope(input={"k": "a b", "long": "x" * 256}, instance_id="i", flow="f", version=1)
    for path in ("$.input.k", "$.input.long"):
        with pytest.raises(PathValueError, match="1-255 printable ASCII"):
            render_concurrency_key(path, spaced)
    with pytest.raises(PathMissing):
        render_concurrency_key("$.input.none", scope, node="reserve")


def test_resolve_time(scope: Scope) -> None:
    assert resolve_time("$.input.remind_at", scope) == datetime(2026, 12, 1, 15, 0, tzinfo=UTC)
    times = make_scope(
        input={"z": "2026-01-01T00:00:00.5Z", "naive": "2026-01-01T00:00:00", "date": "2026-01-01",
               "number": 1767225600, "text": "tomorrow"},
        instance_id="i", flow="f", version=1,
    )  # fmt: skip
    assert resolve_time("$.input.z", times) == datetime(2026, 1, 1, 0, 0, 0, 500000, tzinfo=UTC)
    for path in ("$.input.naive", "$.input.date", "$.input.number", "$.input.text"):
        with pytest.raises(PathValueError, match="not an RFC 3339 time with an offset") as info:
            resolve_time(path, times, node="remind")
        assert info.value.node == "remind" and info.value.path == path
    with pytest.raises(PathMissing) as missing:
        resolve_time("$.input.when", times, node="remind")
    assert missing.value.node == "remind"


@pytest.mark.parametrize(
    ("left", "right", "equal"),
    [
        (1, 1.0, True),
        (1, 2, False),
        (True, True, True),
        (True, 1, False),
        (False, 0, False),
        (None, None, True),
        (None, 0, False),
        (None, False, False),
        ("1", 1, False),
        ("a", "a", True),
        ({"a": [1, {"b": 2.0}]}, {"a": [1.0, {"b": 2}]}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ([1, 2], [2, 1], False),
        ([1], [1, 1], False),
        ([], {}, False),
        (2**60 + 1, float(2**60), False),
    ],
)
def test_json_equal(left: Any, right: Any, equal: bool) -> None:
    assert json_equal(left, right) is equal
    assert json_equal(right, left) is equal


def test_choose_takes_the_first_matching_rule(scope: Scope) -> None:
    def choice(*rules: dict[str, Any]) -> ChoiceNode:
        return ChoiceNode.model_validate({"type": "choice", "rules": list(rules), "default": "fallback"})

    assert (
        choose(choice({"path": "$.steps.reserve.result.big", "equals": True, "next": "big"}), scope) == "big"
    )
    assert (
        choose(choice({"path": "$.steps.reserve.result.big", "equals": 1, "next": "big"}), scope)
        == "fallback"
    )
    assert choose(choice({"path": "$.input.order_id", "equals": 7.0, "next": "seven"}), scope) == "seven"
    # A missing path never equals anything, not even null; a present null does equal null.
    assert choose(choice({"path": "$.input.missing", "equals": None, "next": "x"}), scope) == "fallback"
    assert choose(choice({"path": "$.input.nothing", "equals": None, "next": "x"}), scope) == "x"
    # Presence.
    assert (
        choose(choice({"path": "$.signals.cancel", "present": True, "next": "cancelled"}), scope)
        == "cancelled"
    )
    assert choose(choice({"path": "$.signals.ping", "present": True, "next": "pinged"}), scope) == "pinged"
    assert (
        choose(choice({"path": "$.signals.approve", "present": False, "next": "waiting"}), scope) == "waiting"
    )
    assert choose(choice({"path": "$.signals.cancel", "present": False, "next": "x"}), scope) == "fallback"
    # Order decides.
    two = choice(
        {"path": "$.input.order_id", "equals": 8, "next": "eight"},
        {"path": "$.input.customer", "present": True, "next": "first"},
        {"path": "$.input.order_id", "equals": 7, "next": "second"},
    )
    assert choose(two, scope) == "first"


@pytest.mark.parametrize(
    ("result", "done"),
    [
        ({"done": True}, True),
        ({"done": False}, False),
        ({"done": 1}, False),
        ({"done": "true"}, False),
        ({}, False),
        (None, False),
        ([True], False),
    ],
)
def test_poll_done(result: Any, done: bool) -> None:
    assert poll_done("$.result.done", result) is done


def test_poll_done_on_the_whole_result() -> None:
    assert poll_done("$.result", True) is True
    assert poll_done("$.result[0]", [True]) is True
