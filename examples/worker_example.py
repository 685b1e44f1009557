# examples/worker_example.py
"""Run the handlers of one queue until SIGTERM or Ctrl-C (running tasks finish first).

It handles every task the documentation's examples put on ``fulfilment``: the orders, the flow's ``ship`` step and
the inbox example's receipt follow-ups."""

import os

from orbit_client import OrbitClient, RetryableError, TaskContext, Worker


def fulfil(ctx: TaskContext) -> dict[str, object]:
    order_id = ctx.params["order_id"]
    if ctx.params.get("warehouse_busy"):
        raise RetryableError("warehouse busy")  # reported as retryable: the server schedules another attempt
    ctx.raise_if_cancelled()  # stop here if an operator cancelled the task
    # Hand the fencing number to what you write to, so it can refuse a stale attempt's write.
    reservation = f"R-{order_id}-gen{ctx.generation}"
    return {"order_id": order_id, "reservation": reservation}  # saved as the task's result


def ship(ctx: TaskContext) -> dict[str, object]:  # the order-approval flow's step
    return {"order_id": ctx.params["order_id"], "shipped_by": ctx.params["approved_by"]}


def send_receipt(ctx: TaskContext) -> dict[str, object]:  # the inbox example's follow-up
    return {"receipt_for": ctx.params["task_id"]}


with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"]) as client:
    handlers = {"orders.fulfil": fulfil, "orders.ship": ship, "orders.send_receipt": send_receipt}
    worker = Worker(client, "shop", "fulfilment", handlers, concurrency=4, lease_seconds=30)
    print("worker", worker.worker_id, "ready", flush=True)
    worker.run()  # leases, heartbeats every 10 s while a handler runs, reports; returns after SIGTERM
