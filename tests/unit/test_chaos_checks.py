"""The checks of ``bench.chaos`` find what they look for: each rule fed a history that breaks it reports it
(so a clean chaos run means the rule held, not that it could not fail)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace as Row
from typing import Any

from bench.chaos import checks
from bench.chaos.checks import Placed, Report

T0 = datetime(2026, 12, 1, 12, 0, 0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def attempt(generation: int, status: str, leased: float, finished: float | None, expires: float) -> Row:
    return Row(id=f"a{generation}", task_id="t1", generation=generation, status=status, leased_at=at(leased),
               finished_at=None if finished is None else at(finished), lease_expires_at=at(expires))  # fmt: skip


def task(status: str, attempts: int, version: int) -> dict[str, Any]:
    return {"t1": Row(id="t1", status=status, attempt_count=attempts, current_attempt_id=f"a{attempts}",
                      state_version=version, queue_id=1, params={"order_id": "o1"})}  # fmt: skip


def rules(report: Report) -> set[str]:
    return set(report.counts)


def test_attempts_that_overlap_or_expire_early_are_reported() -> None:
    clean = Report()
    checks._check_attempts(clean, task("SUCCEEDED", 2, 7),
                           [attempt(1, "EXPIRED", 0, 5, 5), attempt(2, "SUCCEEDED", 6, 8, 11)])  # fmt: skip
    assert clean.violations == [] and clean.figures["live_attempt_overlaps"] == 0
    overlap = Report()
    checks._check_attempts(overlap, task("SUCCEEDED", 2, 7),
                           [attempt(1, "EXPIRED", 0, 7, 5), attempt(2, "SUCCEEDED", 6, 8, 11)])  # fmt: skip
    assert "two live attempts at once" in rules(overlap)
    early = Report()
    checks._check_attempts(early, task("SUCCEEDED", 2, 7),
                           [attempt(1, "EXPIRED", 0, 4, 5), attempt(2, "SUCCEEDED", 6, 8, 11)])  # fmt: skip
    assert "attempt expired early" in rules(early) and early.figures["live_attempt_overlaps"] == 1
    gap = Report()
    checks._check_attempts(gap, task("SUCCEEDED", 2, 7),
                           [attempt(1, "EXPIRED", 0, 5, 5), attempt(3, "SUCCEEDED", 6, 8, 11)])  # fmt: skip
    assert "attempt generations not 1..n" in rules(gap)


def event(n: int, version: int, src: str | None, dst: str | None) -> Row:
    return Row(
        task_id="t1", id=n, state_version=version, event="x", from_status=src, to_status=dst, created_at=T0
    )


HISTORY = [(None, "WAITING"), ("WAITING", "LEASED"), ("LEASED", "RUNNING"), ("RUNNING", "SUCCEEDED")]


def test_a_history_with_a_gap_a_bad_transition_or_a_change_after_success_is_reported() -> None:
    events = [event(i + 1, i + 1, src, dst) for i, (src, dst) in enumerate(HISTORY)]
    result = [Row(id="e1", task_id="t1", status="SUCCEEDED", state_version=4)]
    clean = Report()
    checks._check_history(clean, task("SUCCEEDED", 1, 4), events, result)
    assert clean.violations == []
    gap = Report()
    checks._check_history(gap, task("SUCCEEDED", 1, 4), [e for e in events if e.state_version != 2], result)
    assert "state_version history not contiguous" in rules(gap)
    jump = Report()
    bad = [*events[:2], event(3, 3, "LEASED", "SUCCEEDED")]
    checks._check_history(jump, task("SUCCEEDED", 1, 3), bad, [Row(id="e1", task_id="t1", status="SUCCEEDED",
                                                                     state_version=3)])  # fmt: skip
    assert "transition not allowed" in rules(jump)
    after = Report()
    checks._check_history(
        after, task("WAITING", 1, 5), [*events, event(5, 5, "SUCCEEDED", "WAITING")], result
    )
    assert "SUCCEEDED task changed afterwards" in rules(after)
    no_result = Report()
    checks._check_history(no_result, task("SUCCEEDED", 1, 4), events, [])
    assert "result event missing" in rules(no_result)


def order(status: str, **ids: str | None) -> Row:
    return Row(order_id="o1", request_key="k1", status=status, sku="S", quantity=1, amount=Decimal("10.00"),
               fulfilment_key="o1:fulfil", reservation_id=ids.get("reservation_id"), payment_id=ids.get("payment_id"),
               receipt_id=ids.get("receipt_id"))  # fmt: skip


def test_a_double_charge_a_missing_charge_and_a_refused_order_that_exists_are_reported() -> None:
    completed = order("COMPLETED", reservation_id="r", payment_id="p", receipt_id="c")
    effects = [("reserve", "o1", "r"), ("charge", "o1", "p"), ("receipt", "o1", "c")]
    clean = Report()
    checks._check_effects(clean, {"k1": completed}, effects)
    assert clean.violations == [] and clean.figures["double_charged"] == 0
    twice = Report()
    checks._check_effects(twice, {"k1": completed}, [*effects, ("charge", "o1", "p2")])
    assert twice.figures["double_charged"] == 1 and "provider side effect twice" in rules(twice)
    never = Report()
    checks._check_effects(never, {"k1": completed}, effects[:1] + effects[2:])
    assert "completed order not charged once" in rules(never)
    refused = Report()
    body = {"sku": "S", "quantity": 1, "amount": "10.00"}
    checks._check_orders(refused, Placed(acknowledged={}, refused=[("k1", body, False)]), {"k1": completed})
    assert "refused order exists" in rules(refused)
    lost = Report()
    checks._check_orders(lost, Placed(acknowledged={"k1": ("o1", body)}), {})
    assert lost.figures["orders_lost"] == 1 and "acknowledged order missing" in rules(lost)


def test_a_result_applied_twice_or_a_follow_up_enqueued_twice_is_reported() -> None:
    completed = order("COMPLETED")
    results = [Row(id="e1", task_id="t1", status="SUCCEEDED", state_version=4)]
    deliveries = [Row(event_id="e1", state="ACKED")]
    inbox = [Row(event_id="e1", outcome="APPLIED")]
    confirm = Row(queue="confirmations", params={"order_id": "o1"})
    clean = Report()
    checks._check_results(
        clean, {"k1": completed}, [confirm], {}, results, deliveries, inbox, Counter({"e1": 1})
    )
    assert clean.violations == []
    twice = Report()
    checks._check_results(twice, {"k1": completed}, [confirm, confirm], {}, results, deliveries, inbox,
                          Counter({"e1": 2}))  # fmt: skip
    assert twice.figures["results_applied_twice"] == 1
    assert {"result event not applied once", "follow-up not enqueued once"} <= rules(twice)
