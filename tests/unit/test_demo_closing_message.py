"""The demo's closing message names each invariant that failed and the orders it failed for (issue 23: under
load `make demo DEMO_ARGS=--flow` exited 1 saying only "an invariant did not hold")."""

from __future__ import annotations

from examples.order_service.demo_flow import (
    FLOW_INVARIANTS,
    check_flow,
    describe_failures,
    failed_invariants,
)


def test_each_failed_invariant_is_named_with_its_orders() -> None:
    broken = {name: set() for name in FLOW_INVARIANTS}
    broken["every order is terminal"] = {"o-7", "o-3"}
    broken["no cancelled order was charged"] = {f"o-{n:02d}" for n in range(12)}
    failed = failed_invariants(broken)
    assert failed == [
        {"invariant": "every order is terminal", "orders": ["o-3", "o-7"]},
        {"invariant": "no cancelled order was charged", "orders": [f"o-{n:02d}" for n in range(12)]},
    ]
    assert not check_flow({"failed_invariants": failed})
    lines = describe_failures(failed).splitlines()
    assert lines[0] == "  - every order is terminal: 2 order(s): o-3, o-7"
    assert lines[1].startswith("  - no cancelled order was charged: 12 order(s): o-00, o-01")
    assert lines[1].endswith("o-09 and 2 more")


def test_all_invariants_held() -> None:
    assert failed_invariants({name: set() for name in FLOW_INVARIANTS}) == []
    assert check_flow({"failed_invariants": []})
