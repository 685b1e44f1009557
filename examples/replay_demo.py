"""Quick-start demo: one submission sent twice creates one task.

Runs the real ``orbit-server`` CLI and server on the embedded SQLite default
(a fresh ``.demo/orbit.db``), then submits the same task twice with one
idempotency key, as a client would after a timeout, and shows that the second
answer is a replay of the first. Exit status 0 only if that holds.

    python -m examples.replay_demo
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from examples._ports import free_port
from orbit_client import IdempotencyKeyReusedError, OrbitClient, OrbitConnectError

console = Console()
DEMO_DIR = Path(".demo")


def orbit_server(*args: str, database_url: str) -> str:
    """Run one ``orbit-server`` command; return its last stdout line."""
    command = [sys.executable, "-m", "orbit_server", *args, "--database-url", database_url]
    console.print(f"[dim]$ orbit-server {' '.join(args)}[/dim]")
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def wait_until_ready(base_url: str, timeout: float = 30.0) -> None:
    """Poll ``/readyz`` until the server answers 200 (the server has no start-up signal to await)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base_url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the server did not become ready in time")
        time.sleep(0.1)


def main() -> int:
    shutil.rmtree(DEMO_DIR, ignore_errors=True)
    DEMO_DIR.mkdir()
    database_url = f"sqlite:///{DEMO_DIR / 'orbit.db'}"
    console.rule("1. Set up a namespace, a queue and an API key")
    orbit_server("migrate", database_url=database_url)
    orbit_server("namespace", "create", "shop", database_url=database_url)
    orbit_server("queue", "create", "shop", "fulfilment", database_url=database_url)
    api_key = orbit_server("api-key", "create", "shop", "--role", "submit", database_url=database_url)
    console.print(f"API key: {api_key[:12]}… (only its hash is stored)")

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    console.rule(f"2. Start the server on {base_url}")
    log = (DEMO_DIR / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "orbit_server", "serve", "--database-url", database_url, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ORBIT_LOG_LEVEL": "warning"},
    )
    try:
        with OrbitClient(base_url, api_key=api_key, timeout=10) as client:
            wait_until_ready(base_url)
            key = f"order-1001-fulfil-{uuid.uuid4().hex[:8]}"
            params = {"order_id": 1001, "sku": "KAFFEE-MÜHLE-01", "quantity": 2, "amount": "59.90"}
            console.rule(f"3. Submit one task twice with Idempotency-Key {key}")
            first = client.submit_task("shop", "fulfilment", "orders.fulfil", params, idempotency_key=key)
            second = client.submit_task("shop", "fulfilment", "orders.fulfil", params, idempotency_key=key)
            table = Table("answer", "task id", "status", "replayed")
            for label, result in (("first", first), ("second", second)):
                table.add_row(
                    label, result.task.id, result.task.status.value, str(result.replayed)
                )  # fmt: skip
            console.print(table)

            console.rule("4. The same key with other content is refused, not a second task")
            try:
                client.submit_task(
                    "shop", "fulfilment", "orders.fulfil", {**params, "quantity": 3}, idempotency_key=key
                )
                reused_refused = False
            except IdempotencyKeyReusedError as exc:
                console.print(f"422 {exc.code}: {exc.detail}")
                reused_refused = True

            console.rule("5. Look the key up, as a relay does after a timeout")
            found = client.find_submission("shop", key)
            console.print(f"find_submission({key!r}) → task {found.id if found else None}")
            queue = client.get_queue("shop", "fulfilment")
            console.print(
                f"queue 'fulfilment' holds {sum(queue.counts.values())} task(s): { {s.value: n for s, n in queue.counts.items()} }"
            )
    except OrbitConnectError as exc:
        console.print(f"[red]could not reach the server: {exc}[/red]; see {DEMO_DIR / 'server.log'}")
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        log.close()

    holds = (
        not first.replayed
        and second.replayed
        and first.task == second.task
        and reused_refused
        and found is not None
        and found.id == first.task.id
        and sum(queue.counts.values()) == 1
    )
    console.rule("Result")
    if holds:
        console.print(
            "[green]One submission, sent twice: one task. The second answer was a replay of the first.[/green]"
        )
        return 0
    console.print("[red]The replay guarantee did not hold; see above.[/red]")
    return 1


if __name__ == "__main__":
    sys.exit(main())
