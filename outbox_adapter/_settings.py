"""Relay settings, read once from the environment (and flags), typed, failing fast (STYLE habit 10).

Environment variables: ``ORBIT_OUTBOX_DATABASE_URL``, ``ORBIT_URL``, ``ORBIT_API_KEY``,
``ORBIT_OUTBOX_TABLE``, and ``ORBIT_OUTBOX_<FIELD>`` for the relay's tuning fields
(e.g. ``ORBIT_OUTBOX_BATCH_SIZE``). The API key is a ``SecretStr``: it never prints.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["OutboxSettings"]


def _env(name: str, field: str) -> AliasChoices:
    return AliasChoices(field, name)


class OutboxSettings(BaseSettings):
    """Typed configuration of the relay and the ``orbit-outbox`` CLI.

    ``OutboxSettings()`` reads the environment; keyword arguments (by field name) win.

    Raises:
        pydantic.ValidationError: a value is missing or out of range (e.g. no database URL).
    """

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    database_url: str = Field(
        validation_alias=_env("ORBIT_OUTBOX_DATABASE_URL", "database_url"),
        description="SQLAlchemy URL of the business database that holds the outbox.",
    )
    orbit_url: str | None = Field(
        default=None,
        validation_alias=_env("ORBIT_URL", "orbit_url"),
        description="Root URL of the Orbit server.",
    )
    api_key: SecretStr | None = Field(
        default=None,
        validation_alias=_env("ORBIT_API_KEY", "api_key"),
        description="Orbit API key of the rows' namespace (submit role).",
    )
    table: str = Field(
        default="orbit_outbox",
        validation_alias=_env("ORBIT_OUTBOX_TABLE", "table"),
        description="Outbox table name.",
    )
    batch_size: int = Field(
        default=50,
        ge=1,
        le=10_000,
        validation_alias=_env("ORBIT_OUTBOX_BATCH_SIZE", "batch_size"),
        description="Rows claimed, and sent in one batch request (at most 500 items each), at once.",
    )
    concurrency: int = Field(
        default=4,
        ge=1,
        le=256,
        validation_alias=_env("ORBIT_OUTBOX_CONCURRENCY", "concurrency"),
        description="Batch requests in flight at once.",
    )
    lease_seconds: float = Field(
        default=60.0,
        gt=0,
        validation_alias=_env("ORBIT_OUTBOX_LEASE_SECONDS", "lease_seconds"),
        description="Lease length in seconds (database clock); at least twice the request timeout.",
    )
    poll_interval: float = Field(
        default=1.0,
        gt=0,
        validation_alias=_env("ORBIT_OUTBOX_POLL_INTERVAL", "poll_interval"),
        description="Seconds between polls when nothing is due.",
    )
    request_timeout: float = Field(
        default=10.0,
        gt=0,
        validation_alias=_env("ORBIT_OUTBOX_REQUEST_TIMEOUT", "request_timeout"),
        description="HTTP timeout per request, in seconds.",
    )
    max_attempts: int = Field(
        default=5,
        ge=1,
        le=1000,
        validation_alias=_env("ORBIT_OUTBOX_MAX_ATTEMPTS", "max_attempts"),
        description="Default budget of possibly-accepted sends per row.",
    )
    backoff_base: float = Field(
        default=1.0,
        ge=0,
        validation_alias=_env("ORBIT_OUTBOX_BACKOFF_BASE", "backoff_base"),
        description="Upper bound of a row's first backoff, in seconds.",
    )
    backoff_cap: float = Field(
        default=300.0,
        ge=0,
        validation_alias=_env("ORBIT_OUTBOX_BACKOFF_CAP", "backoff_cap"),
        description="Ceiling of a row's backoff, in seconds.",
    )
    shutdown_timeout: float = Field(
        default=30.0,
        ge=0,
        validation_alias=_env("ORBIT_OUTBOX_SHUTDOWN_TIMEOUT", "shutdown_timeout"),
        description="Seconds to finish in-flight sends after SIGTERM.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        validation_alias=_env("ORBIT_OUTBOX_METRICS_PORT", "metrics_port"),
        description="Serve Prometheus metrics on this port (0: a free one); unset: no metrics.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        validation_alias=_env("ORBIT_OUTBOX_METRICS_HOST", "metrics_host"),
        description="Address the metrics server listens on (0.0.0.0: every interface).",
    )
    metrics_sample_interval: float = Field(
        default=15.0,
        gt=0,
        validation_alias=_env("ORBIT_OUTBOX_METRICS_SAMPLE_INTERVAL", "metrics_sample_interval"),
        description="Seconds between two samples of the outbox backlog for the metrics.",
    )
