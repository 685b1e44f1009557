"""Server settings, read once from ``ORBIT_*`` environment variables (and CLI flags)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ServerSettings"]


class ServerSettings(BaseSettings):
    """Typed server configuration.

    Every field is read from the environment variable ``ORBIT_<FIELD>`` (e.g.
    ``ORBIT_DATABASE_URL``) unless given explicitly; the CLI passes its flags in.
    """

    model_config = SettingsConfigDict(env_prefix="ORBIT_", extra="ignore")

    database_url: str = Field(
        default="sqlite:///./orbit.db",
        description="SQLAlchemy URL of the server database; SQLite is migrated at start.",
    )
    host: str = Field(default="127.0.0.1", description="Address `serve` listens on.")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port `serve` listens on.")
    max_body_bytes: int = Field(
        default=256 * 1024, ge=1024, description="Largest request body accepted, in bytes (413 above it)."
    )
    max_batch_items: int = Field(
        default=500,
        ge=1,
        le=5000,
        description="Most items in one POST .../tasks/batch (422 validation_error above it).",
    )
    default_max_attempts: int = Field(
        default=3, ge=1, le=1000, description="max_attempts of a task that gives none."
    )
    submission_key_ttl_seconds: int = Field(
        default=7 * 24 * 3600,
        ge=3600,
        description="How long an idempotency key is remembered, in seconds (default 7 days).",
    )
    db_pool_size: int = Field(
        default=20, ge=1, description="Database connections kept open (as many may overflow)."
    )
    db_ping_idle_seconds: float = Field(
        default=10.0,
        ge=0,
        description=(
            "A pooled database connection idle longer than this, in seconds, is pinged before use and "
            "replaced if the database dropped it; a busy one is not (0: ping before every use)."
        ),
    )
    sweep_interval_seconds: float = Field(
        default=5.0,
        ge=0,
        description=(
            "Seconds between two runs of the lease expiry sweep inside the server; 0 turns the periodic "
            "sweep off (a lease call still sweeps its queue when a lease of it has lapsed)."
        ),
    )
    lease_poll_interval_seconds: float = Field(
        default=0.5,
        gt=0,
        description=(
            "While a lease call long-polls (wait_seconds), how often it looks for due tasks that another "
            "server process made available, in seconds; this process's own submissions (and released "
            "concurrency permits) wake it at once, and on PostgreSQL the other processes' too (notify)."
        ),
    )
    notify: bool = Field(
        default=True,
        description=(
            "On PostgreSQL, wake the long-polls and flow loops of the other server processes on the same "
            "database through LISTEN/NOTIFY, sent after commit and debounced; false: they poll (needed "
            "behind PgBouncer's transaction pooling). Ignored on other databases."
        ),
    )
    notify_interval_seconds: float = Field(
        default=0.01,
        gt=0,
        le=1,
        description=(
            "Least time between two wake-up notifications one server process sends, in seconds; the "
            "wake-ups of a burst within it leave as one notification at its end."
        ),
    )
    api_key_cache_seconds: float = Field(
        default=5.0,
        ge=0,
        description=(
            "How long a verified API key is remembered in the process, in seconds (0: ask the database on "
            "every request). A revoked key keeps working this long."
        ),
    )
    console_secret: str | None = Field(
        default=None,
        description=(
            "Secret that signs the web console's session cookies (/ui); unset, each process makes a random "
            "one, so console sessions end when the server restarts and do not span several server processes."
        ),
    )
    console_login_failures_per_minute: int = Field(
        default=10,
        ge=0,
        description=(
            "Most failed web console sign-ins per client address in any minute, per server process; then "
            "the sign-in page answers 429 with Retry-After (0: no limit)."
        ),
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description=(
            "A token GET /metrics requires as 'Authorization: Bearer TOKEN' (401 without); unset, /metrics "
            "needs no token but answers only requests whose Host is an IP address, localhost or one of "
            "ORBIT_ALLOWED_HOSTS (DNS rebinding)."
        ),
    )
    allowed_hosts: str = Field(
        default="",
        description=(
            "Comma-separated host names the server answers to (the Host header; '*.example.com' allowed); "
            "any other Host gets 400. Empty: any Host, except for /metrics without a token (above)."
        ),
    )
    docs: bool = Field(
        default=True,
        description="Serve the API reference at /docs (Swagger UI) and /redoc, from the package; /openapi.json is always served.",
    )
    log_level: str = Field(default="info", description="Log level: debug, info, warning, error.")
    header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Longest time a client may take to send a request's line and headers, in seconds, counted "
            "from the connection or from the request's first byte; then the connection is closed (408). "
            "Bounds slow-header (slow-loris) clients; a proxy in front should bound it too (README)."
        ),
    )
    max_header_bytes: int = Field(
        default=16 * 1024,
        ge=1024,
        le=1024 * 1024,
        description=(
            "Largest request line plus headers accepted, in bytes (default 16 KiB, as h11's); above it the "
            "server answers 431 and closes the connection."
        ),
    )
    max_headers: int = Field(
        default=100,
        ge=10,
        le=10_000,
        description="Most header fields in one request; above it the server answers 431 and closes the connection.",
    )
    body_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Longest time a client may take to send a request's body once its headers are in, in seconds; "
            "then the server answers 408 request_timeout and closes the connection (a Content-Length "
            "larger than what is sent)."
        ),
    )
    access_log: bool = Field(
        default=True,
        description=(
            "Write one log line per request (logger orbit_server.access, level INFO): client, method, "
            "path, status, milliseconds, request id."
        ),
    )
    fast_lane: bool = Field(
        default=True,
        description=(
            "Serve the plain happy path of the worker calls (start, heartbeat, complete, fail, single and "
            "batched, and leases) without the web framework's routing, for less CPU per call; answers are "
            "the same. false sends every request through the full framework path."
        ),
    )
    access_log_redact: bool = Field(
        default=True,
        description=(
            "In the access log, replace idempotency keys (in .../submissions/{key} paths) and page "
            "cursors (the cursor query parameter) with <redacted>; false logs paths as sent."
        ),
    )
    metrics_sample_interval_seconds: float = Field(
        default=15.0,
        ge=0,
        description=(
            "Seconds between two samples of the /metrics gauges read from the database (live tasks per "
            "queue and status, review backlog, unacked result deliveries); 0 turns the sampling off."
        ),
    )
    scheduler_interval_seconds: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Seconds between two passes of the scheduler inside the server, which fires due schedules; "
            "0 turns it off in this process (another server process may still run it)."
        ),
    )
    flow_interval_seconds: float = Field(
        default=0.2,
        ge=0,
        description=(
            "Seconds between two passes of the flow loop inside the server, which applies task results to "
            "flow instances, fires their timers and starts their poll rounds (a result written by this "
            "process wakes it at once); 0 turns it off in this process (another server process may run it)."
        ),
    )
    flow_workers: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Threads of the flow loop that advance different flow instances at once, per process.",
    )

    @property
    def allowed_host_list(self) -> list[str]:
        """``allowed_hosts`` as a list (empty: any Host)."""
        return [host.strip() for host in self.allowed_hosts.split(",") if host.strip()]
