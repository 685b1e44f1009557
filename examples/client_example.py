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
        if not exc.outcome_known:
            print("outcome unknown; look it up before deciding:", client.find_submission("shop", key))
        elif exc.retryable:  # 429, 503, a refused connection: nothing was created
            print(f"not accepted ({exc}); safe to try again later with the same key")
        else:  # 401/403 (the key), 404 (the queue), 422 (the body): trying again cannot help
            print(f"refused ({exc}); fix the cause before trying again")
        raise
    print(result.task.id, result.task.status, "replayed" if result.replayed else "new")
