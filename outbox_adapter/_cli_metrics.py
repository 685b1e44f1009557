"""The ``--metrics-*`` options of ``orbit-outbox relay`` and ``orbit-outbox consume`` (README "Operations")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

__all__ = ["metrics_options"]

F = TypeVar("F", bound=Callable[..., object])


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
