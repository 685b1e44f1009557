"""Slow clients cannot hold a connection for ever, and the access log keeps secrets out (issue 9).

A real server on a real port, driven through raw sockets: a client that stops in the middle of
its headers, or sends less body than its ``Content-Length`` says, is cut off after the
configured deadline. These are transport rules, the same on every database: SQLite only.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from orbit_server.api.middleware import _redacted_target
from tests.conftest import DatabaseFactory
from tests.servers import RunningServer, run_server

HEADER_TIMEOUT = 0.5
BODY_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def server(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(
        make_database("sqlite"), header_timeout_seconds=HEADER_TIMEOUT, body_timeout_seconds=BODY_TIMEOUT
    ) as running:
        yield running


def _connect(server: RunningServer) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a 10 s socket timeout fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_half_sent_headers_are_cut_off(server: RunningServer) -> None:
    for first in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Half: "):
        with _connect(server) as sock:
            began = time.monotonic()
            sock.sendall(first)
            answer = _read_until_closed(sock)
            waited = time.monotonic() - began
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert HEADER_TIMEOUT * 0.8 <= waited < HEADER_TIMEOUT + 5


def test_a_body_shorter_than_its_content_length_is_answered_408(server: RunningServer) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    keys = server.add_namespace(namespace)
    with _connect(server) as sock:
        began = time.monotonic()
        sock.sendall(
            f"POST /v1/namespaces/{namespace}/tasks HTTP/1.1\r\n".encode()
            + b"Host: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + keys["submit"].encode() + b"\r\n"
            b'Idempotency-Key: slow\r\nContent-Length: 100\r\n\r\n{"queue":'
        )
        answer = _read_until_closed(sock)
        waited = time.monotonic() - began
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b"application/problem+json" in head and b"x-request-id" in head.lower()
    assert b'"code":"request_timeout"' in body
    assert BODY_TIMEOUT * 0.8 <= waited < BODY_TIMEOUT + 5


def test_a_prompt_client_on_a_kept_alive_connection_is_served(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        for _ in range(3):
            assert client.get("/healthz").status_code == 200
            time.sleep(HEADER_TIMEOUT * 0.5)  # idle between requests is keep-alive's business, not ours


def test_the_access_log_redacts_idempotency_keys_and_cursors(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orbit_server.access")
    with httpx.Client(base_url=server.base_url) as client:
        client.get("/v1/namespaces/shop/submissions/secret-key-1")
        client.get("/v1/namespaces/shop/tasks", params={"cursor": "secret-cursor", "limit": 5})
    lines = [r.getMessage() for r in caplog.records if r.name == "orbit_server.access"]
    assert len(lines) == 2, lines
    assert "secret" not in " ".join(lines)
    assert "/submissions/<redacted>" in lines[0] and " 401 " in lines[0] and "request_id=" in lines[0]
    assert "cursor=<redacted>&limit=5" in lines[1]
    assert _redacted_target("/v1/namespaces/a/tasks", b"limit=1&cursor=abc") == (
        "/v1/namespaces/a/tasks?limit=1&cursor=<redacted>"
    )
