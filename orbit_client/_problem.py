"""The error body every failed call answers: RFC 9457 problem details (a leaf: imports no other module)."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
)

__all__ = ["Problem"]


class Problem(BaseModel):
    """An error body: RFC 9457 problem details with Orbit's ``code`` extension member.

    ``code`` is stable and machine-readable (e.g. ``idempotency_key_reused``);
    ``detail`` is for humans and may change.
    """

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    code: str
    request_id: str | None = None
