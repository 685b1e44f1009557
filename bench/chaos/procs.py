"""Child processes of a chaos run: started, SIGKILLed, restarted, and watched for fault markers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["Service"]


@dataclass
class Service:
    """One long-running process (a relay, a worker, ...). Its stderr goes to ``<logs>/<name>.log``;
    a line containing ``marker`` sets :attr:`paused` (a fault hook reached its point)."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    logs: Path
    marker: str | None = None
    #: The file whose creation arms this process's fault hook (``None``: it has none).
    arm_file: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    paused: threading.Event = field(default_factory=threading.Event)
    starts: int = 0
    #: The port it listens on, where that matters (the database proxies).
    port: int = 0
    kills: int = 0
    #: Exits nobody asked for (not a SIGKILL or SIGTERM of the harness), with the log's tail.
    self_exits: list[str] = field(default_factory=list)
    _expected_exit: bool = False

    def start(self) -> None:
        self.paused.clear()
        self._expected_exit = False
        log: IO[bytes] = (self.logs / f"{self.name}.log").open("ab")
        log.write(f"--- start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.starts += 1
        threading.Thread(target=self._pump, args=(self.proc, log), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        assert proc.stderr is not None
        marker = self.marker.encode() if self.marker else None
        for line in proc.stderr:
            log.write(line)
            log.flush()
            if marker is not None and marker in line:
                self.paused.set()
        log.close()
        proc.stderr.close()  # at EOF (the process ended): not left to the garbage collector

    def kill(self) -> None:
        """SIGKILL the process (and anything it started) and reap it."""
        if self.proc is None:
            return
        self._expected_exit = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.kills += 1

    def check(self) -> bool:
        """``True`` if the process is running; records and reports an exit nobody asked for."""
        if self.proc is None or self.proc.poll() is None:
            return True
        if self._expected_exit:
            return False
        self._expected_exit = True
        tail = (self.logs / f"{self.name}.log").read_text(errors="replace")[-1500:]
        self.self_exits.append(f"{self.name} exited with {self.proc.returncode}: ...{tail}")
        return False

    def terminate(self) -> None:
        """Send SIGTERM (a graceful stop); :meth:`wait_or_kill` waits for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._expected_exit = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
