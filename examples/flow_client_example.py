# examples/flow_client_example.py
"""Publish a flow, start one instance per order (however often we retry), signal it, see where it stands."""

import os
import time
import uuid

from orbit_client import OrbitClient, OrbitError

GRAPH = {
    "start": "approval",
    "nodes": {
        "approval": {"type": "signal", "signal": "approve", "timeout_seconds": 3600,
                     "next": "ship", "on_timeout": "expired"},
        "ship": {"type": "task", "queue": "fulfilment", "handler": "orders.ship",
                 "params": {"order_id": "$.input.order_id", "approved_by": "$.signals.approve.by"},
                 "next": "done"},
        "done": {"type": "end"},
        "expired": {"type": "end", "status": "CANCELLED"},
    },
}  # fmt: skip

with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"], timeout=10.0) as client:
    version = client.publish_flow("shop", "order-approval", GRAPH)  # the same graph again: the same version
    key = f"order-{uuid.uuid4()}-approval"  # one key per intended instance, kept with the order
    try:
        started = client.start_flow("shop", "order-approval", {"order_id": 1001}, idempotency_key=key)
    except OrbitError as exc:
        if exc.outcome_known:
            print(f"not started ({exc}); safe to try again later with the same key")
        else:
            print("outcome unknown; look it up before deciding:", client.find_flow_instance("shop", key))
        raise
    instance = started.instance
    # Signals are buffered, and the key is the signal's identity: a retry never approves twice.
    client.signal_flow(
        "shop", instance.id, "approve", {"by": "ops@example.com"}, idempotency_key=f"{key}:approve"
    )

    deadline = time.monotonic() + 30
    while not instance.steps and time.monotonic() < deadline:  # the engine advances within moments
        time.sleep(0.1)
        instance = client.get_flow_instance("shop", instance.id)
    step = instance.steps[0]
    task = client.get_task("shop", step.task_id)  # the step is an ordinary task, made with the token's move
    print(instance.id, f"v{version.version}", step.node, task.handler, task.params["approved_by"])
    for entry in client.get_flow_history("shop", instance.id).items:
        print(" ", entry.event, entry.node or "", entry.to_state or "")
    # The instance now waits for its ship task: the worker of the first-hour tutorial runs it and the instance
    # ends COMPLETED. (Cancelling it instead, cancel_flow_instance, needs an admin key.)
