"""Test helpers for the outbox: a fault-injecting HTTP proxy in front of a real Orbit server,
a TCP proxy that can take a database away, and counts read from the server's own tables.

The fault proxy is a small real ASGI app served by uvicorn on a free port: the relay
talks to it over TCP exactly as to the server, and it forwards to the real server unless
a rule says otherwise. Rules wait on events, never on timers.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import sqlalchemy as sa
import uvicorn
from starlette.types import Message, Receive, Scope, Send

from orbit_server.db.schema import namespaces, submission_keys, tasks
from tests.servers import RunningServer


@dataclass
class Rule:
    """What the proxy does with matching requests.

    ``action``: ``"respond"`` (answer ``status``/``headers``/``body`` itself, forwarding
    nothing), ``"delay"`` (wait ``seconds``, then forward: a slow server), ``"forward_then_drop"`` (forward to the server, then never answer: the
    client's read timeout fires after the server accepted), ``"drop"`` (forward nothing,
    never answer), ``"block"`` (set ``arrived``, wait for ``release``, then forward).
    ``times``: how many requests it applies to (``None``: all). ``key`` matches a single
    submission's ``Idempotency-Key`` or any item's key in a batch submission.
    """

    action: str
    method: str = "POST"
    key: str | None = None
    path_contains: str | None = None
    times: int | None = None
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    hits: int = 0

    def matches(self, method: str, path: str, keys: list[str]) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if method != self.method or (self.key is not None and self.key not in keys):
            return False
        return self.path_contains is None or self.path_contains in path


class FaultProxy:
    """ASGI app forwarding to ``target`` unless a :class:`Rule` matches."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.rules: list[Rule] = []
        #: Called (in a worker thread) with the idempotency keys of each request as it arrives, and the
        #: ``time.monotonic()`` of its arrival (the call itself may start later on a loaded machine).
        self.observer: Callable[[list[str], float], None] | None = None
        self.seen: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()

    def add(self, action: str, **kwargs: Any) -> Rule:
        rule = Rule(action=action, **kwargs)
        with self._lock:
            self.rules.append(rule)
        return rule

    def _match(self, method: str, path: str, keys: list[str]) -> Rule | None:
        with self._lock:
            self.seen.append((method, path, keys[0] if len(keys) == 1 else None))
            for rule in self.rules:
                if rule.matches(method, path, keys):
                    rule.hits += 1
                    return rule
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k.lower() != b"host"
        ]
        key = dict((k.lower(), v) for k, v in headers).get("idempotency-key")
        keys = [key] if key is not None else _batch_keys(scope["path"], body)
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        if self.observer is not None and keys:
            await anyio.to_thread.run_sync(self.observer, keys, time.monotonic())
        rule = self._match(scope["method"], scope["path"], keys)
        if rule is not None and rule.action == "respond":
            await _respond(send, rule.status, rule.headers, rule.body or {})
            return
        if rule is not None and rule.action == "drop":
            await _until_disconnect(receive)
            return
        if rule is not None and rule.action == "delay":
            await anyio.sleep(rule.seconds)
        if rule is not None and rule.action == "block":
            rule.arrived.set()
            await anyio.to_thread.run_sync(rule.release.wait)
        async with httpx.AsyncClient(base_url=self.target, timeout=30) as http:
            response = await http.request(scope["method"], path, headers=headers, content=body)
        if rule is not None and rule.action == "forward_then_drop":
            await _until_disconnect(receive)
            return
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in response.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")
                ]
                + [(b"content-length", str(len(response.content)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": response.content})


def _batch_keys(path: str, body: bytes) -> list[str]:
    """The items' idempotency keys of a batch submission (``POST .../tasks/batch``), else ``[]``."""
    if not path.endswith("/tasks/batch"):
        return []
    import json

    try:
        return [str(item.get("idempotency_key")) for item in json.loads(body)["items"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


async def _respond(send: Send, status: int, headers: dict[str, str], body: dict[str, Any]) -> None:
    import json

    content = json.dumps(body).encode()
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-type", b"application/problem+json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


@contextmanager
def run_fault_proxy(target: str) -> Iterator[tuple[str, FaultProxy]]:
    """Serve a :class:`FaultProxy` for ``target`` on 127.0.0.1:<free port>; yield (base URL, proxy)."""
    proxy = FaultProxy(target)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(proxy, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", proxy
    finally:
        for rule in proxy.rules:
            rule.release.set()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def closed_port() -> int:
    """A local port nothing listens on (connections are refused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


class TcpProxy:
    """A TCP proxy to ``(host, port)`` on a fixed local port that can be taken down and brought back.

    ``down()`` stops listening and cuts every open connection (connections are then
    refused); ``up()`` listens again on the same port.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port: int = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with suppress(OSError):  # wakes the thread blocked in accept(); close() alone would not
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1.0)
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    (b if src is a else a).sendall(data)
        except (OSError, ValueError):  # ValueError: down() closed a socket under select()
            return
        finally:
            for s in (a, b):
                with suppress(OSError):
                    s.close()


def task_count(server: RunningServer, namespace: str) -> int:
    """How many tasks the server holds in ``namespace`` (read from its own tables)."""
    with server.engine.connect() as conn:
        return int(
            conn.scalar(
                sa.select(sa.func.count())
                .select_from(tasks.join(namespaces, tasks.c.namespace_id == namespaces.c.id))
                .where(namespaces.c.name == namespace)
            )
        )


def submission_count(server: RunningServer, key: str) -> int:
    """How many submission records carry ``key`` (in any namespace)."""
    with server.engine.connect() as conn:
        return int(
            conn.scalar(
                sa.select(sa.func.count())
                .select_from(submission_keys)
                .where(submission_keys.c.idempotency_key == key)
            )
        )


def tasks_in_creation_order(server: RunningServer, namespace: str) -> list[dict[str, Any]]:
    """The namespace's tasks (id, params, created_at), oldest first."""
    with server.engine.connect() as conn:
        rows = conn.execute(
            sa.select(tasks.c.id, tasks.c.params, tasks.c.created_at)
            .select_from(tasks.join(namespaces, tasks.c.namespace_id == namespaces.c.id))
            .where(namespaces.c.name == namespace)
            .order_by(tasks.c.created_at, tasks.c.id)
        )
        return [dict(r._mapping) for r in rows]


def wait_until(predicate: Callable[[], bool], *, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until true: only for conditions no event announces (e.g. the database clock
    passing a lease's expiry). Fails the test after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
