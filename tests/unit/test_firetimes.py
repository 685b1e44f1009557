"""Fire times of schedules: cron in a time zone across both DST transitions, intervals, bounds,
misfire policies (orbit_server.schedules.firetimes, orbit_server.schedules.schedules.plan_fires)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from orbit_client import MisfirePolicy
from orbit_server.schedules.firetimes import Trigger, bad_cron, bad_timezone, format_fire_time
from orbit_server.schedules.schedules import idempotency_key, plan_fires

BERLIN = ZoneInfo("Europe/Berlin")


def utc(*args: int) -> datetime:
    """A naive UTC datetime, as the database stores it."""
    return datetime(*args)


def local(fire: datetime) -> str:
    return fire.replace(tzinfo=UTC).astimezone(BERLIN).strftime("%Y-%m-%d %H:%M %Z")


def cron(expression: str, start: datetime = utc(2026, 1, 1), end: datetime | None = None) -> Trigger:
    return Trigger(
        cron=expression, interval_seconds=None, timezone="Europe/Berlin", start_at=start, end_at=end
    )


def test_cron_is_evaluated_in_the_schedules_time_zone() -> None:
    fires = cron("0 2 * * *").first_fires(utc(2026, 1, 10), utc(2026, 1, 13), 10)
    assert fires == [utc(2026, 1, 10, 1), utc(2026, 1, 11, 1), utc(2026, 1, 12, 1)]  # 02:00 CET = 01:00 UTC
    summer = cron("0 2 * * *").first_fires(utc(2026, 7, 1), utc(2026, 7, 1, 12), 10)
    assert summer == [utc(2026, 7, 1, 0)]  # 02:00 CEST = 00:00 UTC


def test_spring_forward_a_missing_local_time_fires_once_at_the_first_instant_after_the_gap() -> None:
    """29 March 2026: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist that day."""
    fires = cron("30 2 * * *").first_fires(utc(2026, 3, 27), utc(2026, 3, 31), 10)
    assert [local(f) for f in fires] == [
        "2026-03-27 02:30 CET",
        "2026-03-28 02:30 CET",
        "2026-03-29 03:00 CEST",  # the first valid instant after the gap, once
        "2026-03-30 02:30 CEST",
    ]
    assert fires[2] == utc(2026, 3, 29, 1)


def test_spring_forward_an_hourly_cron_keeps_its_real_time_cadence() -> None:
    """A ``*`` hour field: 02:30 does not exist, and the fires stay one real hour apart."""
    fires = cron("30 * * * *").first_fires(utc(2026, 3, 29, 0), utc(2026, 3, 29, 2, 59), 10)
    assert [local(f) for f in fires] == [
        "2026-03-29 01:30 CET",
        "2026-03-29 03:30 CEST",
        "2026-03-29 04:30 CEST",
    ]
    assert [b - a for a, b in itertools.pairwise(fires)] == [timedelta(hours=1)] * 2


def test_fall_back_a_repeated_local_time_fires_once_at_its_first_occurrence() -> None:
    """25 October 2026: 03:00 CEST goes back to 02:00 CET; 02:30 happens twice."""
    fires = cron("30 2 * * *").first_fires(utc(2026, 10, 23), utc(2026, 10, 27), 10)
    assert [local(f) for f in fires] == [
        "2026-10-23 02:30 CEST",
        "2026-10-24 02:30 CEST",
        "2026-10-25 02:30 CEST",  # fold=0 only: not again at 02:30 CET
        "2026-10-26 02:30 CET",
    ]
    assert fires[2] == utc(2026, 10, 25, 0, 30)


def test_fall_back_an_every_n_minutes_cron_keeps_its_real_time_cadence() -> None:
    """A ``*`` hour field keeps firing through the repeated hour (Debian cron's rule)."""
    fires = cron("0 * * * *").first_fires(utc(2026, 10, 24, 23), utc(2026, 10, 25, 2), 10)
    assert [local(f) for f in fires] == [
        "2026-10-25 01:00 CEST",
        "2026-10-25 02:00 CEST",
        "2026-10-25 02:00 CET",
        "2026-10-25 03:00 CET",
    ]
    assert [b - a for a, b in itertools.pairwise(fires)] == [timedelta(hours=1)] * 3


def test_interval_counts_utc_seconds_from_the_start_bound() -> None:
    trigger = Trigger(
        cron=None, interval_seconds=90, timezone="Europe/Berlin", start_at=utc(2026, 3, 29, 0, 0, 10)
    )
    assert trigger.first_fires(utc(2026, 3, 29, 0, 1), utc(2026, 3, 29, 0, 5), 10) == [
        utc(2026, 3, 29, 0, 1, 40),
        utc(2026, 3, 29, 0, 3, 10),
        utc(2026, 3, 29, 0, 4, 40),
    ]
    # DST changes nothing: 90 s apart straight through 01:00 UTC (the Berlin jump).
    across = trigger.first_fires(utc(2026, 3, 29, 0, 58), utc(2026, 3, 29, 1, 2), 10)
    assert all(b - a == timedelta(seconds=90) for a, b in itertools.pairwise(across))
    assert trigger.next_fire(utc(2026, 3, 29, 0, 1, 40)) == utc(2026, 3, 29, 0, 3, 10)  # strictly after
    assert trigger.next_fire(utc(2026, 1, 1)) == utc(2026, 3, 29, 0, 0, 10)  # not before the start bound


def test_bounds_are_inclusive_and_nothing_fires_after_the_end() -> None:
    trigger = Trigger(
        cron=None,
        interval_seconds=60,
        timezone="UTC",
        start_at=utc(2026, 5, 1, 12),
        end_at=utc(2026, 5, 1, 12, 2),
    )
    assert trigger.first_fires(utc(2026, 1, 1), utc(2027, 1, 1), 10) == [
        utc(2026, 5, 1, 12), utc(2026, 5, 1, 12, 1), utc(2026, 5, 1, 12, 2)
    ]  # fmt: skip
    assert trigger.next_fire(utc(2026, 5, 1, 12, 2)) is None
    assert cron("0 * * * *", start=utc(2026, 5, 1, 10, 30), end=utc(2026, 5, 1, 12)).first_fires(
        utc(2026, 1, 1), utc(2027, 1, 1), 10
    ) == [utc(2026, 5, 1, 11), utc(2026, 5, 1, 12)]


def test_latest_fire_times_of_a_long_outage() -> None:
    every_minute = cron("* * * * *")
    # 400 days of minutes: the latest three without stepping through all of them from the start.
    assert every_minute.latest(utc(2025, 1, 1), utc(2026, 2, 5, 10, 0, 30), 3) == [
        utc(2026, 2, 5, 9, 58), utc(2026, 2, 5, 9, 59), utc(2026, 2, 5, 10, 0)
    ]  # fmt: skip
    interval = Trigger(cron=None, interval_seconds=10, timezone="UTC", start_at=utc(2026, 1, 1))
    assert interval.latest(utc(2026, 1, 1), utc(2026, 1, 1, 0, 1, 5), 2) == [
        utc(2026, 1, 1, 0, 0, 50),
        utc(2026, 1, 1, 0, 1),
    ]
    assert interval.latest(utc(2026, 1, 1, 0, 0, 1), utc(2026, 1, 1, 0, 0, 9), 5) == []


def _every_minute() -> Trigger:
    return Trigger(cron=None, interval_seconds=60, timezone="UTC", start_at=utc(2026, 6, 1))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (MisfirePolicy.SKIP, []),
        (MisfirePolicy.RUN_ONCE, [(utc(2026, 6, 1, 10, 58), True)]),
        (MisfirePolicy.CATCH_UP, [(utc(2026, 6, 1, 10, 56), True), (utc(2026, 6, 1, 10, 57), True),
                                  (utc(2026, 6, 1, 10, 58), True)]),
    ],
)  # fmt: skip
def test_misfire_policies_after_an_outage(
    policy: MisfirePolicy, expected: list[tuple[datetime, bool]]
) -> None:
    """Down from 09:00 to 10:58:30 with a 60 s grace: every fire time up to 10:58 is missed."""
    now = utc(2026, 6, 1, 10, 59, 30)
    fires, following = plan_fires(
        _every_minute(), utc(2026, 6, 1, 9), now, policy=policy, catch_up_max=3, grace_seconds=60
    )
    on_time = [(utc(2026, 6, 1, 10, 59), False)]  # within the grace: fires whatever the policy
    if policy is MisfirePolicy.RUN_ONCE:
        expected = []  # run_once fires a missed time only when nothing is on time
    assert fires == expected + on_time
    assert following == utc(2026, 6, 1, 11)


def test_run_once_fires_the_latest_missed_time_when_nothing_is_on_time() -> None:
    trigger = Trigger(cron="0 3 * * *", interval_seconds=None, timezone="UTC", start_at=utc(2026, 1, 1))
    now = utc(2026, 6, 10, 12)
    fires, following = plan_fires(
        trigger, utc(2026, 6, 1, 3), now, policy=MisfirePolicy.RUN_ONCE, catch_up_max=5, grace_seconds=60
    )
    assert fires == [(utc(2026, 6, 10, 3), True)]
    assert following == utc(2026, 6, 11, 3)
    skipped, following = plan_fires(
        trigger, utc(2026, 6, 1, 3), now, policy=MisfirePolicy.SKIP, catch_up_max=5, grace_seconds=60
    )
    assert skipped == [] and following == utc(2026, 6, 11, 3)


def test_on_time_fire_times_all_fire_up_to_the_per_pass_limit() -> None:
    every_second = Trigger(cron=None, interval_seconds=1, timezone="UTC", start_at=utc(2026, 6, 1))
    now = utc(2026, 6, 1, 0, 0, 30)
    fires, following = plan_fires(
        every_second,
        utc(2026, 6, 1, 0, 0, 28),
        now,
        policy=MisfirePolicy.SKIP,
        catch_up_max=1,
        grace_seconds=60,
    )
    assert fires == [(utc(2026, 6, 1, 0, 0, s), False) for s in (28, 29, 30)]
    assert following == utc(2026, 6, 1, 0, 0, 31)
    fires, following = plan_fires(
        every_second,
        utc(2026, 6, 1),
        now,
        policy=MisfirePolicy.SKIP,
        catch_up_max=1,
        grace_seconds=60,
        limit=10,
    )
    assert len(fires) == 10 and following == utc(2026, 6, 1, 0, 0, 10)  # the rest in the next pass


def test_validation_messages() -> None:
    assert bad_cron("*/15 9-17 * * mon-fri") is None
    assert "invalid cron expression '61 * * * *'" in (bad_cron("61 * * * *") or "")
    assert bad_cron("* * * *") is not None
    assert bad_timezone("Europe/Berlin") is None
    assert "unknown time zone 'Mars/Olympus'" in (bad_timezone("Mars/Olympus") or "")
    assert bad_timezone("../etc/passwd") is not None


def test_the_idempotency_key_is_the_schedule_id_and_the_utc_fire_time() -> None:
    at = utc(2026, 3, 29, 1)
    assert format_fire_time(at) == "2026-03-29T01:00:00Z"
    assert idempotency_key("0b7c", at) == "schedule:0b7c:2026-03-29T01:00:00Z"
    assert format_fire_time(utc(2026, 3, 29, 1, 0, 0, 5)) == "2026-03-29T01:00:00.000005Z"


@pytest.mark.parametrize(
    "lo",
    [
        utc(2026, 10, 25, 1, 0, 1),
        utc(2026, 10, 25, 1, 10),
        utc(2026, 10, 25, 1, 29, 59),
        utc(2026, 10, 25, 1, 30),
    ],
)
def test_fall_back_a_start_in_the_repeated_hour_never_gets_a_fire_time_before_it(lo: datetime) -> None:
    """From (01:00, 01:30] UTC on 25 October 2026 (the second pass of 02:xx Berlin), cronsim hands
    back the first pass's 00:30 UTC; the next fire is the next day's 02:30 CET."""
    trigger = cron("30 2 * * *")
    assert trigger.next_fire(lo - timedelta(microseconds=1)) == utc(2026, 10, 26, 1, 30)
    assert trigger.first_fires(lo, utc(2026, 10, 27), 5) == [utc(2026, 10, 26, 1, 30)]
    assert all(f >= lo for f in trigger.first_fires(lo, utc(2026, 10, 27), 50))


def test_fall_back_a_minute_step_of_a_named_hour_fires_in_both_passes() -> None:
    """``*/10 2 * * *`` fires 6 times in summer time and 6 in winter time (README "Daylight saving")."""
    fires = cron("*/10 2 * * *").first_fires(utc(2026, 10, 24, 23), utc(2026, 10, 25, 3), 20)
    assert len(fires) == 12
    assert [local(f) for f in fires[5:7]] == ["2026-10-25 02:50 CEST", "2026-10-25 02:00 CET"]
    late = cron("*/10 2 * * *").first_fires(utc(2026, 10, 25, 1, 15), utc(2026, 10, 25, 3), 20)
    assert late == [utc(2026, 10, 25, 1, m) for m in (20, 30, 40, 50)]


def test_a_fire_time_past_year_9999_does_not_exist() -> None:
    # Found by a bad-input pass: a cron schedule starting on 9999-12-31 answered 500 (OverflowError).
    assert cron("0 0 1 1 *", start=utc(9999, 12, 31)).next_fire(utc(9999, 12, 31)) is None
    assert cron("0 0 1 1 *", start=utc(9999, 12, 31)).first_fires(utc(9999, 12, 31), datetime.max, 5) == []
    hourly = Trigger(cron=None, interval_seconds=3600, timezone="UTC", start_at=utc(9999, 12, 31, 22))
    assert hourly.first_fires(utc(9999, 12, 31), datetime.max, 5) == [
        utc(9999, 12, 31, 22),
        utc(9999, 12, 31, 23),
    ]
    assert hourly.next_fire(utc(9999, 12, 31, 23)) is None
