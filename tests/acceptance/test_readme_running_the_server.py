"""The README's "Running the server" blocks run as written, in bash, with only the database URL and the
port changed (issue 10, first hour: after `migrate` with a MariaDB URL the next commands silently wrote to
./orbit.db, and no example sent the key over HTTP)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTION = (
    (REPO / "README.md").read_text(encoding="utf-8").split("## Running the server", 1)[1].split("\n## ", 1)[0]
)
SERVER_BLOCK, CURL_BLOCK = re.findall(r"```sh\n(.*?)```", SECTION, flags=re.S)[:2]
README_URL = "mysql+pymysql://orbit:secret@db/orbit"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_server_block_and_the_curl_example_run_as_written(tmp_path: Path) -> None:
    assert f'export ORBIT_DATABASE_URL="{README_URL}"' in SERVER_BLOCK
    assert "--database-url" not in SERVER_BLOCK  # set once, used by every command
    assert "Authorization: Bearer $KEY" in CURL_BLOCK
    port = _free_port()
    lines = [line for line in SERVER_BLOCK.splitlines() if not line.startswith("pip install")]
    server = "\n".join(lines).replace(README_URL, f"sqlite:///{tmp_path}/orbit.db")
    server = server.replace("--host 0.0.0.0 --port 8080", f"--host 127.0.0.1 --port {port} & SERVER=$!")
    curl = CURL_BLOCK.strip().replace("8080", str(port))
    status_only = curl.replace("curl -sS", "curl -sS -o /dev/null -w '%{http_code}'")
    script = f"""set -euo pipefail
cd "{tmp_path}"
export PATH="{Path(sys.executable).parent}:$PATH"
{server}
trap 'kill $SERVER' EXIT
for _ in $(seq 100); do curl -sf http://127.0.0.1:{port}/readyz >/dev/null && break; sleep 0.1; done
{curl} > first.json
{status_only} > again.txt
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    task = json.loads((tmp_path / "first.json").read_text())
    assert (task["queue"], task["handler"], task["params"]) == (
        "fulfilment",
        "orders.fulfil",
        {"order_id": 42},
    )
    assert (tmp_path / "again.txt").read_text() == "200"  # the same key again: the same task
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == [
        "orbit.db"
    ]  # the URL's database
