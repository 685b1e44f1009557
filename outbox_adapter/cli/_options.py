"""The options more than one ``orbit-outbox`` command takes, each declared once (README "Operations").

Imports no command module: the commands import these.
"""

from __future__ import annotations

import getpass
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from outbox_adapter._exceptions import OutboxUsageError

__all__ = ["ROW_ID", "metrics_options", "parse_duration", "setting"]

F = TypeVar("F", bound=Callable[..., Any])
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


#: An outbox row id on the command line: what a BIGINT column holds (a larger one was a traceback).
ROW_ID = click.IntRange(1, 2**63 - 1)

#: The longest duration taken, in seconds: 100 years (365-day), back from now still a date.
MAX_DURATION = 36_500 * 86400


def parse_duration(text: str) -> float:
    """``"7d"`` → ``604800.0``: a number with an optional unit ``s``, ``m``, ``h``, ``d`` or ``w``
    (no unit: seconds), at most :data:`MAX_DURATION` (36,500 days).

    Raises:
        OutboxUsageError: not a duration, or a longer one.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise OutboxUsageError(f"{text!r} is not a duration; write e.g. 90s, 30m, 12h, 7d or 2w")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds > MAX_DURATION:
        raise OutboxUsageError(f"{text!r} is longer than 36500d (100 years), the longest duration taken")
    return seconds


class _Duration(click.ParamType):  # type: ignore[type-arg]
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except OutboxUsageError as exc:
            self.fail(str(exc), param, ctx)


def _database_options(func: F) -> F:
    func = click.option(
        "--table",
        envvar="ORBIT_OUTBOX_TABLE",
        show_envvar=True,
        default="orbit_outbox",
        show_default=True,
        help="Name of the outbox table (its audit table is <table>_events).",
    )(func)
    return click.option(
        "--database-url",
        envvar="ORBIT_OUTBOX_DATABASE_URL",
        show_envvar=True,
        required=True,
        help="SQLAlchemy URL of the business database, e.g. mysql+pymysql://app:pw@db/shop.",
    )(func)


def _orbit_options(api_key_help: str, *, required: bool = True) -> Callable[[F], F]:
    """``--orbit-url``, ``--api-key`` (``api_key_help`` says which role the command needs) and ``--timeout``."""

    def decorate(func: F) -> F:
        return _orbit_options_on(func, api_key_help, required=required)

    return decorate


def _orbit_options_on(func: F, api_key_help: str, *, required: bool) -> F:
    func = click.option(
        "--timeout",
        "request_timeout",
        envvar="ORBIT_OUTBOX_REQUEST_TIMEOUT",
        show_envvar=True,
        type=click.FloatRange(min=0, min_open=True),
        default=10.0,
        show_default=True,
        help="HTTP timeout per request, in seconds.",
    )(func)
    func = click.option(
        "--api-key",
        envvar="ORBIT_API_KEY",
        show_envvar=True,
        required=required,
        help=api_key_help,
    )(func)
    return click.option(
        "--orbit-url",
        envvar="ORBIT_URL",
        show_envvar=True,
        required=required,
        help="Root URL of the Orbit server, e.g. https://orbit.example.com.",
    )(func)


def _json_option(func: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of tables."
    )(func)


#: Longest ``--actor``: the audit trail's ``actor`` column.
ACTOR_MAX_LENGTH = 255


def _check_actor(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None and len(value) > ACTOR_MAX_LENGTH:
        raise click.BadParameter(
            f"is {len(value)} characters long; at most {ACTOR_MAX_LENGTH} fit the audit trail"
        )
    return value


def _actor_option(func: F) -> F:
    return click.option(
        "--actor",
        envvar="ORBIT_OUTBOX_ACTOR",
        show_envvar=True,
        default=None,
        callback=_check_actor,
        help="Who acts, for the audit trail. Default: operator:<login name> (at most 255 characters).",
    )(func)


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return f"operator:{getpass.getuser()}"
    except (KeyError, OSError):
        return "operator:unknown"


def _inbox_table_option(func: F) -> F:
    return click.option(
        "--inbox-table",
        envvar="ORBIT_INBOX_TABLE",
        show_envvar=True,
        default=None,
        help="Name of the inbox table. Default: the outbox table's name with 'outbox' replaced by 'inbox' "
        "(orbit_inbox), else <table>_inbox.",
    )(func)


def metrics_options(env_prefix: str, *, sampled: bool) -> Callable[[F], F]:
    """``--metrics-port`` and ``--metrics-host`` (and, with ``sampled``, ``--metrics-sample-interval``),
    each with its ``<env_prefix>_...`` environment variable."""

    def decorate(func: F) -> F:
        if sampled:
            func = click.option(
                "--metrics-sample-interval",
                envvar=f"{env_prefix}_METRICS_SAMPLE_INTERVAL",
                show_envvar=True,
                default=15.0,
                show_default=True,
                type=click.FloatRange(min=0, min_open=True),
                help="Seconds between two samples of the outbox backlog (rows per state, oldest pending age).",
            )(func)
        func = click.option(
            "--metrics-host",
            envvar=f"{env_prefix}_METRICS_HOST",
            show_envvar=True,
            default="127.0.0.1",
            show_default=True,
            help="Address the metrics server listens on (0.0.0.0: every interface; keep it internal).",
        )(func)
        return click.option(
            "--metrics-port",
            envvar=f"{env_prefix}_METRICS_PORT",
            show_envvar=True,
            type=click.IntRange(0, 65535),
            default=None,
            help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, logged); unset: none.",
        )(func)

    return decorate


def setting(flag: str, envvar: str, default: Any, kind: click.ParamType[Any], help: str) -> Callable[[F], F]:
    """An option with a default and an environment variable, both shown in ``--help``
    (``orbit-outbox relay`` and ``consume`` take a dozen such)."""
    return click.option(
        flag, envvar=envvar, show_envvar=True, default=default, show_default=True, type=kind, help=help
    )
