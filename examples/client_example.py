# examples/client_example.py
"""Submit a task so that a retry can never create a second one."""

import os
import uuid

from orbit_client import OrbitClient, OrbitError

with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"], timeout=10.0) as client:
    # One key per intended task, made once and kept (store it beside the business record in real code):
    # every retry of this submission must send the same key.
    key = f"order-{uuid.uuid4()}-fulfil"
    try:
        result = client.submit_task(
            "shop", "fulfilment", "orders.fulfil", {"order_id": 1001, "amount": "59.90"}, idempotency_key=key
        )
    except OrbitError as exc:
        if exc.outcome_known:
            print(f"not accepted ({exc}); safe to try again later with the same key")
        else:
            print("outcome unknown; look it up before deciding:", client.find_submission("shop", key))
        raise
    print(result.task.id, result.task.status, "replayed" if result.replayed else "new")
