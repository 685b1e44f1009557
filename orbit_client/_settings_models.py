"""What a server publishes about itself for clients and relays (``GET /v1/settings``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ServerInfo"]


class ServerInfo(BaseModel):
    """The settings of an Orbit server that clients and relays depend on (README "Retention and the key window").

    Attributes:
        submission_key_ttl_seconds: the key window: how long, at least, the server remembers
            an idempotency key after accepting it, in seconds (``ORBIT_SUBMISSION_KEY_TTL_SECONDS``).
            A resend with the same key within the window replays the original task; after it,
            once ``orbit-server purge --keys`` has run, the key may be forgotten and a resend
            would create a new task. Relays never send a row older than this without first
            settling it by its key.
        max_batch_items: most items one ``POST .../tasks/batch`` takes.
        max_body_bytes: largest request body accepted, in bytes.
        lease_and_start: whether a lease request may ask for its grants already ``RUNNING``
            (``LeaseRequest.start``, README "Workers"); ``False`` from a server that predates it.
        report_and_lease: whether a ``complete``/``fail`` batch may carry a lease request
            (``CompleteBatch.lease``); ``False`` from a server that predates it.
        item_task_ids: whether the items of a ``start``/``complete`` batch may name their
            attempt's task (``StartItem.task_id``, ``CompleteItem.task_id``); ``False`` from a server
            that predates it (it refuses the field).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    submission_key_ttl_seconds: int = Field(ge=1)
    max_batch_items: int = Field(ge=1)
    max_body_bytes: int = Field(ge=1)
    lease_and_start: bool = False
    report_and_lease: bool = False
    item_task_ids: bool = False
