"""``bench.chaos`` injects exactly the faults it is asked for (issue 20 #12: 26 of 30 at 300 orders, 100 of
106 armed at 2,000): a hooked fault whose point is not reached at first is tried again while orders are in
flight, as often as it takes; one that cannot be reached any more is reported as a violation."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench.chaos import run
from bench.chaos.run import Chaos, Options


def _chaos(tmp_path: Path, orders: int = 300) -> Chaos:
    opts = Options(orders, 30, 7, 0, 1, 1, 1, False, 60.0, False, tmp_path / "run")
    return Chaos(opts)


def test_a_hooked_fault_not_reached_at_first_is_retried_until_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chaos = _chaos(tmp_path)
    misses = Counter[str]()

    def fault(kind: str) -> bool:  # each hooked kind is not reached 5 times before it is
        if kind in run.HOOKED and misses[kind] < 5:
            misses[kind] += 1
            return False
        return True

    monkeypatch.setattr(chaos, "fault", fault)
    monkeypatch.setattr(chaos, "watch", lambda: None)
    monkeypatch.setattr(run.time, "sleep", lambda _s: None)
    plan = run.schedule(chaos.rng, 30, 0)
    chaos.run_faults(plan, lambda _i: True)  # orders still in flight all along
    assert sum(chaos.stats.faults.values()) == 30
    assert chaos.stats.faults == Counter(plan)
