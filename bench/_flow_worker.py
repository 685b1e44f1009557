"""The worker process of ``bench.flows``: the steps of the 3-step flow (echo handlers) and the same three
steps as plain tasks, each of which submits the next one when it finishes (how a task queue without
flows chains steps: procrastinate's jobs defer the next job the same way).

python -m bench._flow_worker URL WORK_KEY SUBMIT_KEY NS QUEUE CONCURRENCY
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from orbit_client import OrbitClient, TaskContext, Worker

#: The flow's steps (task nodes) and the chained tasks, in order.
FLOW_STEPS = ("bench.flow.a", "bench.flow.b", "bench.flow.c")
CHAIN_STEPS = ("bench.chain.a", "bench.chain.b", "bench.chain.c")


def echo(ctx: TaskContext) -> Any:
    return {"n": ctx.params["n"]}


def chained(submitter: OrbitClient, namespace: str, queue: str, after: str | None) -> Any:
    def step(ctx: TaskContext) -> Any:
        if after is not None:  # the next step, at most once per chain (its key is derived from the chain's)
            p = ctx.params
            submitter.submit_task(namespace, queue, after, p, idempotency_key=f"{p['run']}-{p['n']}-{after}")
        return {"n": ctx.params["n"]}

    return step


def main() -> None:
    url, work_key, submit_key, namespace, queue, concurrency = sys.argv[1:7]
    local = threading.local()

    def submitter() -> OrbitClient:  # one client per handler thread
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = OrbitClient(url, api_key=submit_key, timeout=60)
        return client

    class _Submitter:
        def submit_task(self, *args: Any, **kwargs: Any) -> Any:
            return submitter().submit_task(*args, **kwargs)

    proxy: Any = _Submitter()
    handlers: dict[str, Any] = dict.fromkeys(FLOW_STEPS, echo)
    for step, after in zip(CHAIN_STEPS, (*CHAIN_STEPS[1:], None), strict=True):
        handlers[step] = chained(proxy, namespace, queue, after)
    with OrbitClient(url, api_key=work_key, timeout=60) as client:
        Worker(
            client,
            namespace,
            queue,
            handlers,
            concurrency=int(concurrency),
            lease_seconds=30,
            poll_wait_seconds=1,
        ).run()


if __name__ == "__main__":
    main()
