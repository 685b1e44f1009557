"""A canned Orbit API for ``bench.worker_cpu --server canned``: it grants tasks forever and answers every
report at once, so that a worker's own CPU per task is measured without a server's or a database's share.

    python bench/_canned_server.py      # prints the port it listens on (127.0.0.1), then serves

Answers ``GET /v1/settings`` (lease-and-start and report-and-lease offered), ``POST .../leases`` with
``max_tasks`` new grants (``LEASED``: each needs its ``start``), and every batched attempt call with one
``200`` item per item sent, plus ``max_tasks`` new grants when the batch carries a lease request. One
asyncio loop, HTTP/1.1 keep-alive, no validation: a bench fixture, not a server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

_TS = "2026-12-05T08:30:00.123456Z"
_ids = itertools.count(1)
_SETTINGS = {
    "submission_key_ttl_seconds": 86400,
    "max_batch_items": 500,
    "max_body_bytes": 262144,
    "lease_and_start": True,
    "report_and_lease": True,
}
_STATUS = {"start": "RUNNING", "heartbeat": "RUNNING", "complete": "SUCCEEDED", "fail": "FAILED"}


def _grant() -> dict[str, Any]:
    n = next(_ids)
    task = {
        "id": f"T{n:025d}", "namespace": "bench", "queue": "q", "handler": "bench.echo", "params": {"n": n},
        "status": "LEASED", "state_version": 2, "attempt_count": 1, "max_attempts": 3, "retry_safe": False,
        "available_at": _TS, "deadline": None, "cancel_requested": False, "result": None, "error": None,
        "retry_of": None, "created_at": _TS, "updated_at": _TS, "current_attempt_id": f"A{n:025d}",
        "cancel_reason": None, "backoff_base_seconds": None, "backoff_cap_seconds": None, "finished_at": None,
        "concurrency_key": None, "priority": 0, "traceparent": None, "tracestate": None,
    }  # fmt: skip
    attempt = {"id": f"A{n:025d}", "generation": 1, "lease_token": "t" * 43, "lease_expires_at": _TS}
    return {"task": task, "attempt": attempt}


def _answer(path: str, body: bytes) -> Any:
    action = path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
    if action == "settings":
        return _SETTINGS
    data = json.loads(body) if body else {}
    if action == "leases":
        return [_grant() for _ in range(data.get("max_tasks", 1))]
    status = _STATUS[action]
    items = [
        {"status": 200, "error": None, "attempt": {
            "attempt_id": item["attempt_id"], "task_id": "T", "generation": 1, "status": status,
            "task_status": status, "lease_expires_at": _TS, "cancel_requested": False,
        }}
        for item in data["items"]
    ]  # fmt: skip
    out: dict[str, Any] = {"items": items}
    if "lease" in data:
        out["grants"] = [_grant() for _ in range(data["lease"]["max_tasks"])]
        out["lease_error"] = None
    return out


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            path = head[0].split()[1]
            length = next(
                (int(line.split(":")[1]) for line in head if line.lower().startswith("content-length:")), 0
            )
            body = await reader.readexactly(length) if length else b""
            out = json.dumps(_answer(path, body)).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ndate: Sat, 05 Dec 2026 08:30:00 GMT\r\nserver: uvicorn\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: 0123456789abcdef\r\n\r\n"
                % len(out)
                + out
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


async def _main() -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main())
