"""Fire times of schedules: cron in an IANA time zone, or a fixed interval in UTC (README "Schedules").

Pure functions over naive UTC datetimes (how the database stores time); no SQL here.

Cron expressions are parsed and evaluated by `cronsim <https://pypi.org/project/cronsim/>`_ in the
schedule's local time zone, with these daylight-saving rules (the rules of Debian's cron, which
cronsim implements and the unit tests pin):

- **A local time that does not exist** (spring forward, e.g. 02:30 Europe/Berlin on the last
  Sunday of March) fires **once, at the first valid instant after the gap** (03:00 local).
- **A local time that occurs twice** (fall back, e.g. 02:30 Europe/Berlin on the last Sunday of
  October) fires **once, at its first occurrence** (``fold=0``, still summer time).
- Both rules are for expressions that name the hour *and* the minute. An expression with a
  range or step in the minute field of a named hour (``*/10 2 * * *``) fires in **both passes**
  of the repeated hour (Debian cron does the same): 12 fires that night instead of 6.
- An expression with ``*`` in the hour field (hourly, every N minutes) keeps its real-time
  cadence through both transitions: it fires nothing extra at the end of the gap, and it fires
  during the repeated hour too (its times there are one real hour apart from those of the first
  pass).
- Whatever the library answers, no fire time is ever before the ``lo`` asked for.

Intervals are plain UTC arithmetic: ``start_at + k * interval_seconds`` for k = 0, 1, 2, ...
Both kinds are bounded by ``start_at`` and ``end_at`` (inclusive).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from cronsim import CronSim, CronSimError

__all__ = ["Trigger", "bad_cron", "bad_timezone", "format_fire_time", "zone"]

_MICRO = timedelta(microseconds=1)
#: How many cron fire times :meth:`Trigger.latest` steps through before it jumps closer to the end.
_MAX_STEPS = 100_000
_JUMP_BACK = timedelta(days=2)


@lru_cache(maxsize=512)
def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; raises :class:`ValueError` if there is no such zone."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"unknown time zone {name!r}; use an IANA name such as 'Europe/Berlin' or 'UTC'"
        ) from exc


#: Files of the time zone database that are no zone a schedule may name: ``localtime`` is the host's
#: zone (a different one on each server), ``Factory`` a placeholder ("-00") of installers.
_NOT_ZONES = frozenset({"localtime", "Factory", "posixrules"})


@lru_cache(maxsize=1)
def _known_zones() -> frozenset[str]:
    return frozenset(available_timezones()) - _NOT_ZONES


def bad_timezone(name: str) -> str | None:
    """Why ``name`` is not an IANA time zone, or ``None`` if it is one (any name of the time zone
    database but ``localtime``, ``Factory`` and ``posixrules``)."""
    try:
        zone(name)
    except ValueError as exc:
        return str(exc)
    if name not in _known_zones():
        return f"unknown time zone {name!r}; use an IANA name such as 'Europe/Berlin' or 'UTC'"
    return None


def bad_cron(expression: str) -> str | None:
    """Why ``expression`` is not a valid five-field cron expression, or ``None`` if it is."""
    fields = len(expression.split())
    if fields != 5:
        return f"invalid cron expression {expression!r}: it has {fields} fields, not 5"
    try:
        CronSim(expression, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        return f"invalid cron expression {expression!r}: {exc}"
    return None


def format_fire_time(value: datetime) -> str:
    """A naive UTC fire time as RFC 3339 with ``Z`` (microseconds only when there are some)."""
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond:06d}"
    return text + "Z"


def _representable(times: Iterator[datetime]) -> Iterator[datetime]:
    """``times`` up to the last one a ``datetime`` can hold (year 9999): a fire time past it does not
    exist, so the schedule has no more (its ``next_fire_at`` is empty), never an ``OverflowError``."""
    while True:
        try:
            yield next(times)
        except (StopIteration, OverflowError):
            return


@dataclass(frozen=True, slots=True)
class Trigger:
    """When a schedule fires. Datetimes are naive UTC; exactly one of cron and interval is set."""

    cron: str | None
    interval_seconds: int | None
    timezone: str
    start_at: datetime
    end_at: datetime | None = None

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.interval_seconds is None):
            raise ValueError("a trigger has exactly one of cron and interval_seconds")

    # ---------------------------------------------------------------- forward

    def fires_from(self, lo: datetime) -> Iterator[datetime]:
        """Fire times ``>= lo`` (and within the bounds), ascending."""
        lo = max(lo, self.start_at)
        if self.interval_seconds is not None:
            step = timedelta(seconds=self.interval_seconds)
            k = -((self.start_at - lo) // step)  # ceil((lo - start) / step)
            times: Iterator[datetime] = (self.start_at + n * step for n in itertools.count(k))
        else:
            times = self._cron_from(lo)
        times = _representable(times)
        end = self.end_at
        return times if end is None else itertools.takewhile(lambda t: t <= end, times)

    def _cron_from(self, lo: datetime) -> Iterator[datetime]:
        assert self.cron is not None
        tz = zone(self.timezone)
        # cronsim yields times strictly after the minute of its start: start just before lo.
        local = (lo - _MICRO).replace(tzinfo=UTC).astimezone(tz)
        for fire in CronSim(self.cron, local):
            at = fire.astimezone(UTC).replace(tzinfo=None)
            # A start inside the second pass of a repeated hour (fold=1) gets the first pass's
            # time back from cronsim (e.g. 00:30 UTC for '30 2 * * *' Berlin from 01:10 UTC on the
            # fall-back day): never a time before lo, whatever the library hands back.
            if at >= lo:
                yield at

    def next_fire(self, after: datetime) -> datetime | None:
        """The first fire time strictly after ``after``, or ``None`` past ``end_at``."""
        return next(iter(self.fires_from(after + _MICRO)), None)

    def first_fires(self, lo: datetime, hi: datetime, limit: int) -> list[datetime]:
        """Up to ``limit`` fire times in ``[lo, hi]``, the earliest first."""
        return list(itertools.islice(itertools.takewhile(lambda t: t <= hi, self.fires_from(lo)), limit))

    # --------------------------------------------------------------- backward

    def latest(self, lo: datetime, hi: datetime, limit: int) -> list[datetime]:
        """The latest ``limit`` fire times in ``[lo, hi]``, ascending (``limit`` 0: none)."""
        if limit <= 0 or hi < lo:
            return []
        if self.interval_seconds is not None:
            lo, hi = max(lo, self.start_at), min(hi, self.end_at or hi)
            if hi < lo:
                return []
            step = timedelta(seconds=self.interval_seconds)
            k_lo = -((self.start_at - lo) // step)
            k_hi = (hi - self.start_at) // step
            first = max(k_lo, k_hi - limit + 1)
            return [self.start_at + k * step for k in range(first, k_hi + 1)]
        kept: deque[datetime] = deque(maxlen=limit)
        for steps, fire in enumerate(self.fires_from(lo)):
            if fire > hi:
                break
            if steps >= _MAX_STEPS and lo < hi - _JUMP_BACK:
                # A long outage of a frequent cron: the latest `limit` (<= 1000) are within 2 days.
                return self.latest(max(lo, hi - _JUMP_BACK), hi, limit)
            kept.append(fire)
        return list(kept)
