"""Fault hooks for the acceptance tests: make a real relay or consumer process stop at a chosen point.

**Test-only.** Read once, when a :class:`~outbox_adapter.Relay` or
:class:`~outbox_adapter.ResultConsumer` is built, from the environment variable
``ORBIT_OUTBOX_FAULT`` (unset in production: no hook runs):

- ``pause-after-send``: after a send returns, and *before* its outcome is recorded,
  write ``ORBIT_OUTBOX_FAULT paused-after-send row_id=N`` to stderr and block that send
  for ever. The test then kills the process (SIGKILL), which is the crash "between send
  and record" of DESIGN §5.
- ``delay-before-send=SECONDS``: wait that long before each send, after writing
  ``ORBIT_OUTBOX_FAULT sending row_id=N`` to stderr (a slow network, to catch a relay
  with a send in flight, e.g. for the SIGTERM test).
- ``pause-after-commit`` (consumer): after a result event's transaction commits and
  *before* its delivery is acked, write ``ORBIT_OUTBOX_FAULT paused-after-commit
  event_id=E`` to stderr and block for ever: the crash "between commit and ack".

A pausing hook may be gated by a file: ``pause-after-send@/path/arm`` (or
``pause-after-commit@/path/arm``) runs normally until the file ``/path/arm`` exists; the
first send (commit) after that removes the file and pauses, so one arming gives exactly one
pause, at whatever moment the process reaches that point next. ``bench.chaos`` arms
long-running processes this way at the moments of its fault schedule.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV_VAR", "Faults"]

ENV_VAR = "ORBIT_OUTBOX_FAULT"


@dataclass(frozen=True)
class Faults:
    """Which fault hooks are on (see the module docstring)."""

    pause_after_send: bool = False
    delay_before_send: float = 0.0
    pause_after_commit: bool = False
    #: The file whose presence arms the pausing hook (``None``: always armed).
    gate: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Faults | None:
        """The hooks named by ``ORBIT_OUTBOX_FAULT``, or ``None`` when it is unset or empty.

        Raises:
            ValueError: an unknown hook name (a typo must not silently test nothing).
        """
        value = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
        if not value:
            return None
        name, _, gate = value.partition("@")
        if name == "pause-after-send":
            return cls(pause_after_send=True, gate=gate or None)
        if name == "pause-after-commit":
            return cls(pause_after_commit=True, gate=gate or None)
        if value.startswith("delay-before-send="):
            return cls(delay_before_send=float(value.split("=", 1)[1]))
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a known fault hook (pause-after-send[@FILE], delay-before-send=S, "
            "pause-after-commit[@FILE])"
        )

    def before_send(self, row_id: int) -> None:
        if self.delay_before_send:
            _say(f"sending row_id={row_id}")
            time.sleep(self.delay_before_send)

    def _armed(self) -> bool:
        """True when the hook should pause now: no gate, or the gate file existed (it is removed)."""
        if self.gate is None:
            return True
        try:
            os.remove(self.gate)  # atomic: of concurrent threads, exactly one takes the arming
        except FileNotFoundError:
            return False
        return True

    def after_send(self, row_id: int) -> None:
        if self.pause_after_send and self._armed():
            _say(f"paused-after-send row_id={row_id}")
            threading.Event().wait()  # until the process is killed

    def after_commit(self, event_id: str) -> None:
        if self.pause_after_commit and self._armed():
            _say(f"paused-after-commit event_id={event_id}")
            threading.Event().wait()  # until the process is killed


def _say(what: str) -> None:
    sys.stderr.write(f"{ENV_VAR} {what}\n")
    sys.stderr.flush()
