"""The pipelined worker's lease sizing (``orbit_client._pipeline.Pipeline.want``), without a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from orbit_client._pipeline import Held, Pipeline


def _hold(pipe: Pipeline, waiting: int, running: int = 0, reporting: int = 0) -> None:
    grant: Any = SimpleNamespace(task=SimpleNamespace(status="LEASED"))
    pipe.waiting.clear()
    pipe.waiting.extend(Held(grant, False, 1e12, 1e12) for _ in range(waiting))
    pipe.running, pipe.reporting = running, reporting


def test_a_worker_with_a_round_of_grants_in_hand_leases_in_bulk() -> None:
    """Concurrency 1, a prefetch of 16: while a grant waits for the slot, no lease until there is
    room for 8 (half the prefetch), then one for all the room; what is held at most is unchanged."""
    pipe = Pipeline(concurrency=1, lease_seconds=30.0, prefetch_cap=16)
    pipe.observe(0.003)
    assert pipe.prefetch() == 16
    _hold(pipe, waiting=16, running=1)
    assert pipe.want() == 0
    _hold(pipe, waiting=9, running=1)  # room for 7
    assert pipe.want() == 0
    assert pipe.want(freeing=1) == 8  # a report carrying the ask frees its slot: room for 8
    _hold(pipe, waiting=8, running=1)
    assert pipe.want() == 8
    _hold(pipe, waiting=1, running=1, reporting=6)
    assert pipe.want() == 9


def test_a_worker_with_too_few_grants_in_hand_asks_for_any_room_at_once() -> None:
    pipe = Pipeline(concurrency=4, lease_seconds=30.0, prefetch_cap=16)
    pipe.observe(0.003)
    _hold(pipe, waiting=3, running=4, reporting=12)  # room for 1, and a slot would find nothing after 3
    assert pipe.want() == 1
    _hold(pipe, waiting=4, running=4, reporting=11)  # room for 1, a round in hand: wait for more room
    assert pipe.want() == 0


def test_before_a_handler_returned_nothing_is_prefetched_and_every_free_slot_is_asked_for() -> None:
    pipe = Pipeline(concurrency=4, lease_seconds=30.0, prefetch_cap=16)
    assert pipe.prefetch() == 0
    assert pipe.want() == 4
    _hold(pipe, waiting=0, running=3)
    assert pipe.want() == 1
    _hold(pipe, waiting=4)
    assert pipe.want() == 0
