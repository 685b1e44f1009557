"""``examples/django_shop`` runs as its README section says, with one command on SQLite: orders saved
with their fulfilment in one atomic block (refused ones rolled back), a relay killed between send and
record, a worker killed after a charge; every placed order COMPLETED once and charged once, one Orbit
task each, nothing for a rolled-back order (the demo checks and exits 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_django_shop_demo_keeps_its_invariants_through_crashes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "ORBIT_TEST_DJANGO")}
    done = subprocess.run(
        [sys.executable, "-m", "examples.django_shop.demo", "--orders", "8", "--dir", str(tmp_path / "shop")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "placed 6 orders, refused (rolled back) 2" in done.stdout
    assert "relay killed between a send and its record" in done.stdout
    assert "worker killed after a charge" in done.stdout
    assert "6 orders COMPLETED once, charged once, 6 Orbit tasks; outbox {'DELIVERED': 6}" in done.stdout
    assert "all invariants hold" in done.stdout
