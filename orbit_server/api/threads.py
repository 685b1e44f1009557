"""The hot worker calls' hop from the event loop into a worker thread, cheaper than ``run_in_threadpool``.

Starlette's :func:`~starlette.concurrency.run_in_threadpool` goes through anyio (a capacity limiter, a
cancel scope, run variables and a ``queue.Queue`` whose ``Condition`` wakes the thread): about a tenth
of a ``start``'s server CPU, and more of an empty lease's (issue 28, ``python -m bench.call_floor``).
:func:`in_thread` hands the call to a :class:`~concurrent.futures.ThreadPoolExecutor` with
:meth:`asyncio.loop.run_in_executor`, with the same guarantees the fast lane relies on: the call sees
the caller's context variables (a copy, as anyio gives it), and a cancellation of the awaiting task
either stops the call before it began or waits for it to end (its transaction committed or rolled
back) before it goes on, as anyio's shielded wait does. The pool has as many threads as anyio's default limiter allows
(40 unless changed), created as needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import anyio.to_thread

__all__ = ["in_thread"]

P = ParamSpec("P")
T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                size = int(anyio.to_thread.current_default_thread_limiter().total_tokens)
                _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="orbit-call")
    return _pool


async def in_thread(func: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``func(*args, **kwargs)`` run in a worker thread, in a copy of the caller's context; its value, or
    its exception raised here. Cancelling the caller stops ``func`` before it began, or waits for it to end (module docstring).

    Must be called from a running event loop."""
    future = _executor().submit(contextvars.copy_context().run, func, *args, **kwargs)  # type: ignore[arg-type]
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # The wrapper's cancellation cancelled ``future`` if it had not started; else it runs to its end.
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((asyncio.wrap_future(future),))
        raise
